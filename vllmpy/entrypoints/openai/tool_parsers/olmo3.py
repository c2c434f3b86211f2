"""olmo3: Olmo 3 writes its calls one per line, as Python calls, between tags::

    <function_calls>
    get_weather(city="Paris", metric=true)
    get_time()
    </function_calls>

JSON's ``true`` / ``false`` / ``null`` are read as values (see ``python_calls``). Text
outside the tags is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.python_calls import PythonCallsToolParser


class Olmo3PythonicToolParser(PythonCallsToolParser):
    start = "<function_calls>"
    end = "</function_calls>"
