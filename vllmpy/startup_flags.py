"""The engine flags that start-up checks before any model I/O: the JSON-valued flags
(``--kv-transfer-config``, ``--offload-config``), parsed and validated as vLLM's
dataclasses and refused by name where they enable what is not built; ``--max-logprobs``;
``--chat-template``; the CUDA-graph-replay profiler flags (``check_startup_flags``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllmpy.config import ConfigError, EngineArgs, log


def json_object_flag(flag: str, value: str | dict[str, Any], example: str) -> dict[str, Any]:
    """A flag's JSON object (a dict passes as it is); malformed JSON or another JSON value
    is refused naming the flag."""
    if isinstance(value, dict):
        return value
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: malformed JSON ({e.msg} at column {e.colno}); pass a "
                          f"JSON object such as '{example}'") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} must be a JSON object such as '{example}', got "
                          f"{type(data).__name__}")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# kind -> (how a message names it, the check)
_KINDS: dict[str, tuple[str, Any]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", _is_int),
    "float": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "dict": ("a JSON object", lambda v: isinstance(v, dict)),
    "names": ("a list of strings",
              lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}


def _fields(flag: str, data: dict[str, Any], spec: dict[str, tuple[Any, ...]],
            prefix: str = "") -> dict[str, Any]:
    """``data`` checked against ``spec`` (name -> (kind, default[, minimum])), defaults
    filled in. Kinds: those of ``_KINDS`` ("names" is kept as a frozenset) or a tuple of
    the allowed strings. Unknown fields are refused; ``prefix`` names a nested object."""
    unknown = sorted(set(data) - set(spec))
    if unknown:
        where = f" of {prefix[:-1]}" if prefix else ""
        raise ConfigError(f"{flag}: unknown field {prefix + unknown[0]!r}; the fields{where} "
                          f"are {', '.join(spec)}")
    out = {}
    for name, (kind, default, *minimum) in spec.items():
        value = out[name] = data.get(name, default)
        if value is None and default is None:
            continue
        if isinstance(kind, tuple) and value not in kind:
            raise ConfigError(f"{flag}: {prefix}{name} must be one of {', '.join(kind)}, "
                              f"got {value!r}")
        if isinstance(kind, str) and not _KINDS[kind][1](value):
            raise ConfigError(f"{flag}: {prefix}{name} must be {_KINDS[kind][0]}, got "
                              f"{value!r}")
        if minimum and value < minimum[0]:
            raise ConfigError(f"{flag}: {prefix}{name} must be >= {minimum[0]}, got {value!r}")
        if kind == "names":
            out[name] = frozenset(value)
    return out


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config``: vLLM's KVTransferConfig fields and validators."""

    kv_connector: str | None = None  # the connector moving KV caches between instances
    engine_id: str | None = None  # this engine's id in KV transfers
    kv_buffer_device: str | None = None  # where the connector buffers KV (None: the device)
    kv_role: str | None = None  # one of KV_ROLES; needed with kv_connector
    kv_port: int = 14579  # the connector's port
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)  # its own options
    kv_connector_module_path: str | None = None  # module the connector is loaded from
    enable_permute_local_kv: bool = False  # HND -> NHD transfer (experimental upstream)
    kv_load_failure_policy: str = "fail"  # a failed KV load: "recompute" or "fail"

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        flag = "--kv-transfer-config"
        data = json_object_flag(flag, value, '{"kv_connector": "...", "kv_role": "kv_both"}')
        spec: dict[str, tuple[Any, ...]] = {
            "kv_connector": ("str", None), "engine_id": ("str", None),
            "kv_buffer_device": ("str", None), "kv_role": ("str", None),
            "kv_port": ("int", 14579), "kv_connector_extra_config": ("dict", {}),
            "kv_connector_module_path": ("str", None), "enable_permute_local_kv": ("bool", False),
            "kv_load_failure_policy": (("recompute", "fail"), "fail")}
        config = cls(**_fields(flag, data, spec))
        if config.kv_role is not None and config.kv_role not in KV_ROLES:
            raise ConfigError(f"{flag}: Unsupported kv_role: {config.kv_role}. Supported "
                              f"roles are {KV_ROLES}")
        if config.kv_connector is not None and config.kv_role is None:
            raise ConfigError(f"{flag}: Please specify kv_role when kv_connector is set, "
                              f"supported roles are {KV_ROLES}")
        return config


@dataclass(frozen=True)
class OffloadConfig:
    """``--offload-config``: vLLM's OffloadConfig (backend, ``uva`` and ``prefetch``
    sub-configs, with their fields), with its validators; a backend/field mismatch is
    ``mismatch``, which start-up logs, as upstream warns."""

    offload_backend: str = "auto"  # "auto" (from the fields set), "uva" or "prefetch"
    cpu_offload_gb: float = 0.0  # uva: GiB of weights kept in pinned host memory
    cpu_offload_params: frozenset[str] = frozenset()  # uva: parameter-name segments to offload
    offload_group_size: int = 0  # prefetch: layers per group (0: off)
    offload_num_in_group: int = 1  # prefetch: last layers of each group offloaded
    offload_prefetch_step: int = 1  # prefetch: layers fetched ahead
    offload_params: frozenset[str] = frozenset()  # prefetch: parameter-name segments

    @property
    def enabled_backend(self) -> str | None:
        """The backend that would offload weights, None when nothing is offloaded."""
        uva, prefetch = self.cpu_offload_gb > 0, self.offload_group_size > 0
        if self.offload_backend == "auto":
            return "prefetch" if prefetch else "uva" if uva else None
        return self.offload_backend if {"uva": uva, "prefetch": prefetch}[
            self.offload_backend] else None

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> OffloadConfig:
        flag = "--offload-config"
        data = json_object_flag(flag, value, '{"offload_backend": "uva", "uva": '
                                             '{"cpu_offload_gb": 8}}')
        top = _fields(flag, data, {"offload_backend": (("auto", "uva", "prefetch"), "auto"),
                                   "uva": ("dict", {}), "prefetch": ("dict", {})})
        uva = _fields(flag, top["uva"], {
            "cpu_offload_gb": ("float", 0.0, 0), "cpu_offload_params": ("names", [])}, "uva.")
        prefetch = _fields(flag, top["prefetch"], {
            "offload_group_size": ("int", 0, 0), "offload_num_in_group": ("int", 1, 1),
            "offload_prefetch_step": ("int", 1, 0), "offload_params": ("names", [])},
            "prefetch.")
        config = cls(offload_backend=top["offload_backend"], **uva, **prefetch)
        config._validate(flag)
        return config

    def _validate(self, flag: str) -> None:
        if self.offload_backend == "prefetch" or self.offload_group_size > 0:
            if self.offload_num_in_group > self.offload_group_size:
                raise ConfigError(f"{flag}: offload_num_in_group ({self.offload_num_in_group})"
                                  f" must be <= offload_group_size ({self.offload_group_size})")
            if self.offload_prefetch_step < 1:
                raise ConfigError(f"{flag}: offload_prefetch_step "
                                  f"({self.offload_prefetch_step}) must be >= 1 when prefetch "
                                  f"offloading is enabled (offload_group_size > 0)")

    @property
    def mismatch(self) -> str | None:
        """What upstream warns of: fields set for a backend other than the one chosen."""
        uva, prefetch = self.cpu_offload_gb > 0, self.offload_group_size > 0
        if self.offload_backend == "uva" and prefetch:
            return "prefetch fields are set but offload_backend='uva'; they are ignored"
        if self.offload_backend == "prefetch" and uva:
            return "uva fields are set but offload_backend='prefetch'; they are ignored"
        if self.offload_backend == "auto" and uva and prefetch:
            return ("both uva and prefetch fields are set with offload_backend='auto'; "
                    "prefetch is selected (set offload_backend to silence this)")
        return None


DEFAULT_CUDA_PROFILE_GRAPH_BATCH = 16


def check_startup_flags(args: EngineArgs, device: str, notify: bool = True) -> None:
    """Refuse, before any model I/O, what the flags alone decide: ``--max-logprobs`` below
    -1; a ``--chat-template`` that is missing, does not compile or leaves the sandbox; a
    ``--kv-transfer-config`` / ``--offload-config`` that is malformed, has unknown fields,
    breaks a validator or enables what is not built; the CUDA-graph-replay profiler flags.
    ``device`` is the resolved device, or the ``--device`` value before torch is loaded;
    ``notify`` logs an offload mismatch (once per start-up: the engine's own call)."""
    if args.max_logprobs < -1:
        raise ConfigError(f"--max-logprobs must be >= -1 (-1: no limit), got "
                          f"{args.max_logprobs}")
    if args.chat_template is not None:
        from vllmpy.tokenizer.chat_template import load_chat_template_arg

        load_chat_template_arg(args.chat_template)
    if args.kv_transfer_config is not None:
        kv = KVTransferConfig.from_json(args.kv_transfer_config)
        if kv.kv_connector is not None:
            raise ConfigError(f"--kv-transfer-config names kv_connector {kv.kv_connector!r}, "
                              f"which is not supported yet: no KV connector is built; drop "
                              f"the flag (a config without kv_connector is accepted)")
    if args.offload_config is not None:
        offload = OffloadConfig.from_json(args.offload_config)
        if notify and offload.mismatch:
            log(f"--offload-config: {offload.mismatch}")
        backend = offload.enabled_backend
        if backend is not None:
            raise ConfigError(f"--offload-config enables {backend} weight offloading, which "
                              f"is not supported yet: no weight offloader is built, for any "
                              f"architecture; drop the flag or leave offloading disabled")
    _check_cuda_profiler(args, device)
    if args.speculative_config is not None:
        from vllmpy.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.from_json(args.speculative_config)


def _check_cuda_profiler(args: EngineArgs, device: str) -> None:
    replays, batch = args.cuda_profile_graph_replays, args.cuda_profile_graph_batch
    for flag, value in (("--cuda-profile-graph-replays", replays),
                        ("--cuda-profile-graph-batch", batch)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    traced = DEFAULT_CUDA_PROFILE_GRAPH_BATCH if batch is None and replays > 0 else batch
    if traced is not None and traced > args.max_num_seqs:
        how = " (its default when replays are armed)" if batch is None else ""
        raise ConfigError(f"--cuda-profile-graph-batch {traced}{how} exceeds --max-num-seqs "
                          f"{args.max_num_seqs}; lower it or raise --max-num-seqs")
    if replays > 0:
        why = ("the cpu device replays no CUDA graphs" if device == "cpu" else "that "
               "trace-only diagnostic is not built into this engine")
        raise ConfigError(f"--cuda-profile-graph-replays {replays} arms the CUDA-graph-replay "
                          f"profiler, and {why}; leave it at 0")
