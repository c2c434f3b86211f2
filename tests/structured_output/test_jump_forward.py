"""--enable-jump-forward with the real SmolLM2 model: a schema with long forced keys gives
the same text as without the flag, in fewer forward steps (counted on the engine).

Whitespace is switched off (disable_any_whitespace): the appended tokens may split the
forced text differently from how the model would have, and where whitespace is free that
can change the spaces the model writes next; the values stay the model's choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vllmpy import LLM, SamplingParams
from vllmpy.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

KEY_1 = "the_name_of_the_first_property_which_is_long_and_forced"
KEY_2 = "another_rather_long_property_name_the_grammar_dictates"
SCHEMA = {"type": "object",
          "properties": {KEY_1: {"type": "integer", "minimum": 0, "maximum": 9},
                         KEY_2: {"type": "boolean"}},
          "required": [KEY_1, KEY_2]}
# The prompts name the values, so which value the model writes does not hinge on how the
# forced keys were split into tokens (greedy constrained decoding often spells a key letter
# by letter; jump-forward appends its usual tokens).
PROMPTS = [f'Reply with a JSON object where "{KEY_1}" is 7 and "{KEY_2}" is true.',
           f'Reply with a JSON object where "{KEY_1}" is 3 and "{KEY_2}" is false.']


def run(llm: LLM) -> tuple[list[str], int]:
    """The texts, and the number of forward steps the engine ran for them."""
    runner = llm.engine.engine_core.model_runner
    execute = runner.execute_model
    steps = 0

    def counting(out):
        nonlocal steps
        steps += out.total_num_scheduled_tokens > 0
        return execute(out)

    runner.execute_model = counting
    try:
        params = SamplingParams(temperature=0, max_tokens=96,
                                structured_outputs=StructuredOutputsParams(
                                    json=SCHEMA, disable_any_whitespace=True))
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                        use_tqdm=False)
    finally:
        del runner.execute_model  # back to the method
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    return [out.outputs[0].text for out in outs], steps


def test_jump_forward_gives_the_same_text_in_fewer_steps(llm, llm_jump):
    assert llm_jump.config.enable_jump_forward and not llm.config.enable_jump_forward
    texts, steps = run(llm)
    jumped_texts, jumped_steps = run(llm_jump)
    assert jumped_texts == texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # both keys are forced after their opening quote: most of their tokens are skipped
    assert jumped_steps < steps - 10, (jumped_steps, steps)
