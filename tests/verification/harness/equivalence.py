"""Proof that the K3 DSpark drafter behaves like pristine vLLM's on CUDA: traces.

`test_nvidia_equivalence.py` builds the drafter twice in one process, on CPU,
with the harness's synthetic draft (``drafter.py``: HF config, vLLM config,
checkpoint, caches):

* from the pristine release's `vllm/models/kimi_k3/nvidia/dspark_mla.py`
  (its source read from git through `tests.support.pristine`, executed under
  a private module name so it cannot collide with the installed module), and
* from whatever `vllm.models.kimi_k3.nvidia.dspark_mla` the installed (or
  `PYTHONPATH`) vLLM provides; with the stack applied that is the thin NVIDIA
  subclass of `vllm/models/kimi_k3/common/dspark_mla.py`.

Everything that cannot run on CPU is replaced the same way for both builds:

* the attention backend and prefill backend selection inside
  `MultiHeadLatentAttention` (the backend's impl is `RecordingMLAImpl`, whose
  `do_kv_cache_update` is a recorder with a plain-torch cache write),
* every function of `vllm._custom_ops` (recorders; the few the drafter uses
  get a plain-torch body so later calls see their effect),
* `torch.cuda.is_current_stream_capturing` (raises without a driver) and the
  workspace manager's buffers (zeroed, so that traces compare).

A `Trace` is the comparable record of one run: recorded calls with their
arguments (tensors by dtype, shape and exact bytes; KV caches and pointer
arrays by the label of the cache they refer to), plus named outputs. The
same scenario run on both builds must yield equal traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from tests.support.pristine import base_tag, pristine_source
from tests.verification.harness import drafter, ops, reference

DRAFTER_RELPATH = "vllm/models/kimi_k3/nvidia/dspark_mla.py"
DRAFTER_MODULE = "vllm.models.kimi_k3.nvidia.dspark_mla"
PRISTINE_MODULE = "_k3_equivalence_pristine_nvidia_dspark_mla"
PUBLIC_NAMES = ("K3DSparkForCausalLM", "K3DSparkModel", "K3DSparkDecoderLayer")

NUM_DRAFT_LAYERS = 3
NUM_BLOCKS = 6
BLOCK_SIZE = 4

_FP8_TORCH_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# --------------------------------------------------------------------------
# The two implementations
# --------------------------------------------------------------------------


def load_pristine_module() -> types.ModuleType:
    """Execute the pristine drafter source under a private module name."""
    if PRISTINE_MODULE in sys.modules:
        return sys.modules[PRISTINE_MODULE]
    source = pristine_source(DRAFTER_RELPATH)
    spec = importlib.util.spec_from_loader(PRISTINE_MODULE, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"<pristine {base_tag()}>/{DRAFTER_RELPATH}"
    sys.modules[PRISTINE_MODULE] = module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[PRISTINE_MODULE]
        raise
    return module


def load_current_module() -> types.ModuleType:
    return importlib.import_module(DRAFTER_MODULE)


# --------------------------------------------------------------------------
# Comparable descriptions of values
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class TensorValue:
    """A tensor compared by dtype, shape and exact bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorValue:
        return cls(t.dtype, tuple(t.shape), t.detach().clone().contiguous())

    def _bytes(self) -> torch.Tensor:
        flat = self.data.reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        return flat.view(torch.uint8)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorValue)
            and self.dtype == other.dtype
            and self.shape == other.shape
            and torch.equal(self._bytes(), other._bytes())
        )

    def __hash__(self) -> int:  # pragma: no cover - not used in sets
        return hash((self.dtype, self.shape))

    def __repr__(self) -> str:
        preview = self.data.reshape(-1)[:6].tolist() if self.data.numel() else []
        return f"Tensor({self.dtype}, {list(self.shape)}, first={preview})"


@dataclasses.dataclass(frozen=True)
class CacheRef:
    """A KV cache tensor the test allocated, named by its label."""

    label: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CachePointers:
    """A device array of cache base addresses, named by the caches it points to."""

    labels: tuple[str, ...]


class Describer:
    """Turns arguments into comparable values; knows the test's KV caches."""

    def __init__(self) -> None:
        self.caches: dict[int, tuple[str, torch.Tensor]] = {}
        self.objects: dict[int, str] = {}
        self.writes: list[tuple[int, int]] = []  # filled by the reference kernel

    def register_cache(self, label: str, cache: torch.Tensor) -> None:
        self.caches[cache.data_ptr()] = (label, cache)

    def register_object(self, label: str, obj: object) -> None:
        self.objects[id(obj)] = label

    def resolve(self, ptr: int) -> torch.Tensor:
        """The cache at a base address (the reference grouped kernel's memory)."""
        return self.caches[ptr][1]

    def pointers(self, t: torch.Tensor) -> CachePointers:
        labels = []
        for ptr in t.reshape(-1).tolist():
            entry = self.caches.get(int(ptr))
            labels.append(entry[0] if entry else f"<unknown address {int(ptr):#x}>")
        return CachePointers(tuple(labels))

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.numel() and value.data_ptr() in self.caches:
                label, cache = self.caches[value.data_ptr()]
                return CacheRef(label, value.dtype, tuple(value.shape))
            return TensorValue.of(value)
        if id(value) in self.objects:
            return self.objects[id(value)]
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(self(v) for v in value)
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, torch.device):
            return str(value)
        if isinstance(value, nn.Module):
            return f"<module {type(value).__name__}>"
        return f"<{type(value).__module__}.{type(value).__qualname__}>"


@dataclasses.dataclass
class Trace:
    """What one run of a scenario did, in a form that compares across builds."""

    calls: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """Describe the first place where two descriptions differ, or None."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if list(expected) != list(actual):
            missing = [k for k in expected if k not in actual]
            extra = [k for k in actual if k not in expected]
            return (
                f"{path or '<root>'}: keys differ; only in pristine: {missing}; "
                f"only in current: {extra}"
            )
        for key in expected:
            diff = first_difference(expected[key], actual[key], f"{path}[{key!r}]")
            if diff:
                return diff
        return None
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        for i, (e, a) in enumerate(zip(expected, actual)):
            diff = first_difference(e, a, f"{path}[{i}]")
            if diff:
                return diff
        if len(expected) != len(actual):
            return (
                f"{path or '<root>'}: length {len(expected)} (pristine) != "
                f"{len(actual)} (current); extra: "
                f"{list(expected[len(actual) :] or actual[len(expected) :])[:3]}"
            )
        return None
    if expected != actual:
        return f"{path or '<root>'}: pristine {expected!r} != current {actual!r}"
    return None


def assert_equivalent(expected: Any, actual: Any, what: str) -> None:
    diff = first_difference(expected, actual)
    assert diff is None, f"{what} differs from pristine vLLM: {diff}"


# --------------------------------------------------------------------------
# Recorders for the custom ops the drafter launches (the few whose effect
# later calls see run the harness's plain-torch bodies: ops.py, reference.py)
# --------------------------------------------------------------------------


OUTPUT_PARAMS = frozenset({"out", "output"})


class CallLog:
    """Replaces custom ops with recorders while active; collects a Trace."""

    FAKES: dict[str, Callable[..., Any]] = {
        "rms_norm": reference.rms_norm,
        "rotary_embedding": ops.rotary_embedding,
    }

    def __init__(self) -> None:
        self.describer = Describer()
        self.trace = Trace()

    def record(self, name: str, fn: Callable[..., Any], args, kwargs) -> None:
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
        except (TypeError, ValueError):
            described = (self.describer(args), self.describer(kwargs))
        else:
            bound.apply_defaults()
            described = {}
            for pname, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and "ptr" in pname:
                    described[pname] = self.describer.pointers(value)
                elif isinstance(value, torch.Tensor) and pname in OUTPUT_PARAMS:
                    # Output buffers hold uninitialised memory before the call.
                    described[pname] = (
                        "output buffer",
                        value.dtype,
                        tuple(value.shape),
                    )
                else:
                    described[pname] = self.describer(value)
        self.trace.calls.append((name, described))

    def _grouped_insert(self, *args, **kwargs):
        reference.concat_and_cache_mla_grouped(
            *args, **kwargs, registry=self.describer, rocm=False
        )

    def op_recorder(self, name: str, original: Callable[..., Any]):
        body = self.FAKES.get(name)
        if name == "concat_and_cache_mla_grouped":
            body = self._grouped_insert

        def recorder(*args, **kwargs):
            self.record(f"ops.{name}", original, args, kwargs)
            if body is not None:
                return body(*args, **kwargs)
            return None

        recorder.__wrapped__ = original  # type: ignore[attr-defined]
        return recorder


_ACTIVE_LOG: CallLog | None = None


def active_log() -> CallLog:
    assert _ACTIVE_LOG is not None, "no CallLog is active"
    return _ACTIVE_LOG


class RecordingMLAImpl:
    """Stands in for the MLA backend impl; records the per-layer cache update."""

    lse_base_on_e = True
    supports_quant_query_input = False

    def __init__(self, **kwargs: Any) -> None:
        self.init_kwargs = kwargs

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        log = active_log()
        log.record(
            "impl.do_kv_cache_update",
            RecordingMLAImpl.do_kv_cache_update,
            (self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale),
            {"skip_scale": skip_scale},
        )
        if kv_cache.numel() == 0:
            return
        reference.concat_and_cache_mla(
            kv_c_normed,
            k_pe.squeeze(1),
            kv_cache,
            slot_mapping,
            kv_cache_dtype,
            k_scale,
            skip_scale,
            fp8_dtype=_FP8_TORCH_DTYPES.get(kv_cache_dtype, torch.float8_e4m3fn),
        )


class _RecordingMLABackend:
    @staticmethod
    def get_name() -> str:
        return "RECORDING_MLA"

    @staticmethod
    def get_impl_cls() -> type:
        return RecordingMLAImpl


class _RecordingPrefillBackend:
    def __init__(self, **kwargs: Any) -> None:
        self.init_kwargs = kwargs


class _WorkspaceStub:
    """`current_workspace_manager()` stand-in: fresh zeroed CPU buffers."""

    def get_simultaneous(self, *shapes_and_dtypes):
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]


# --------------------------------------------------------------------------
# Process-wide environment
# --------------------------------------------------------------------------


def _kimi_k3_modules() -> list[types.ModuleType]:
    mods = []
    for name, mod in list(sys.modules.items()):
        if mod is None:
            continue
        if name == PRISTINE_MODULE or name.startswith("vllm.models.kimi_k3"):
            mods.append(mod)
    return mods


def _replace_everywhere(
    mp: Any, original: object, replacement: object, modules: list[types.ModuleType]
) -> int:
    """Rebind every module global that is `original` (however it was imported)."""
    count = 0
    for mod in modules:
        for attr, value in list(vars(mod).items()):
            if value is original:
                mp.setattr(mod, attr, replacement)
                count += 1
    return count


@contextlib.contextmanager
def cpu_environment() -> Iterator[dict[str, types.ModuleType]]:
    """Single-rank gloo TP group (the harness's) plus the stand-ins both builds
    share: the recording backend, custom ops and zeroed workspace (so that
    traces compare), and no stream capture (no CUDA driver here)."""
    import pytest

    pristine = load_pristine_module()
    current = load_current_module()

    with drafter.config_context(drafter.make_vllm_config(drafter.make_hf_config())):
        drafter.init_dist()

    import vllm._custom_ops as ops_module
    import vllm.v1.attention.backends.mla.prefill.selector as prefill_selector
    import vllm.v1.attention.selector as attn_selector
    import vllm.v1.worker.workspace as workspace

    with pytest.MonkeyPatch.context() as mp:
        modules = _kimi_k3_modules()
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        mp.setattr(workspace, "_manager", _WorkspaceStub())
        _replace_everywhere(
            mp,
            attn_selector.get_attn_backend,
            lambda *a, **k: _RecordingMLABackend,
            modules,
        )
        _replace_everywhere(
            mp,
            prefill_selector.get_mla_prefill_backend,
            lambda vllm_config: _RecordingPrefillBackend,
            modules,
        )
        # Every public function of vllm._custom_ops becomes a recorder, both
        # on the module and wherever a drafter module imported it by name.
        for name, fn in list(vars(ops_module).items()):
            if (
                inspect.isfunction(fn)
                and fn.__module__ == ops_module.__name__
                and not name.startswith("_")
            ):
                recorder = _dispatching_recorder(name, fn)
                mp.setattr(ops_module, name, recorder)
                _replace_everywhere(mp, fn, recorder, modules)
        yield {"pristine": pristine, "current": current}


def _dispatching_recorder(name: str, original: Callable[..., Any]):
    def recorder(*args, **kwargs):
        log = _ACTIVE_LOG
        if log is None:
            raise AssertionError(f"custom op {name} called outside a recorded run")
        return log.op_recorder(name, original)(*args, **kwargs)

    recorder.__wrapped__ = original  # type: ignore[attr-defined]
    return recorder


@contextlib.contextmanager
def recording() -> Iterator[CallLog]:
    global _ACTIVE_LOG
    assert _ACTIVE_LOG is None
    _ACTIVE_LOG = CallLog()
    try:
        yield _ACTIVE_LOG
    finally:
        _ACTIVE_LOG = None


# --------------------------------------------------------------------------
# Building the drafter
# --------------------------------------------------------------------------


def _submodule_classes() -> list[type]:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.qwen3_dspark import (
        DSparkConfidenceHead,
        DSparkMarkovHead,
    )
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.models.kimi_k3.nvidia.model import KimiMLP

    return [
        MultiHeadLatentAttention,
        KimiMLP,
        RMSNorm,
        ReplicatedLinear,
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        ParallelLMHead,
        DSparkMarkovHead,
        DSparkConfidenceHead,
        LogitsProcessor,
        nn.Embedding,
    ]


@contextlib.contextmanager
def constructor_recording(describer: Describer) -> Iterator[list]:
    """Record (instance, class name, bound arguments) of submodule constructors.

    Only the outermost constructor of each instance is recorded, with default
    values filled in, so `super().__init__` chains and explicit defaults do
    not matter.
    """
    import pytest

    records: list[tuple[nn.Module, str, dict[str, Any]]] = []
    constructing: set[int] = set()

    def wrap(cls: type, original: Callable[..., None]):
        signature = inspect.signature(original)

        def __init__(self, *args, **kwargs):
            if id(self) in constructing:
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: describer(v) for k, v in bound.arguments.items()}
            arguments.pop(next(iter(signature.parameters)))
            records.append((self, type(self).__name__, arguments))
            constructing.add(id(self))
            try:
                original(self, *args, **kwargs)
            finally:
                constructing.discard(id(self))

        return __init__

    with pytest.MonkeyPatch.context() as mp:
        for cls in _submodule_classes():
            mp.setattr(cls, "__init__", wrap(cls, cls.__dict__["__init__"]))
        yield records


@dataclasses.dataclass
class Built:
    model: nn.Module
    vllm_config: Any
    hf_config: Any
    constructors: dict[str, tuple[str, dict[str, Any]]]


def build_drafter(
    module: types.ModuleType, *, confidence_head: bool, cache_dtype: str = "auto"
) -> Built:
    from vllm.config import set_current_vllm_config

    hf_config = drafter.make_hf_config(
        rope="default",
        confidence=confidence_head,
        num_layers=NUM_DRAFT_LAYERS,
        logit_scale=1.25,
    )
    # Both builds share vLLM's layers: run their plain-torch bodies, eagerly.
    vllm_config = drafter.make_vllm_config(
        hf_config, cache_dtype=cache_dtype, eager=True, custom_ops=["none"]
    )
    describer = Describer()
    describer.register_object("<vllm_config>", vllm_config)
    describer.register_object("<draft hf_config>", hf_config)
    describer.register_object("<cache_config>", vllm_config.cache_config)
    describer.register_object("<quant_config>", vllm_config.quant_config)

    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with (
            set_current_vllm_config(vllm_config),
            constructor_recording(describer) as records,
        ):
            model = module.K3DSparkForCausalLM(vllm_config=vllm_config, prefix="")
    finally:
        torch.set_default_dtype(previous_dtype)

    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    constructors: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, (instance, cls_name, arguments) in enumerate(records):
        key = paths.get(id(instance), f"<not in module tree #{i}>")
        constructors[key] = (cls_name, arguments)
    return Built(model, vllm_config, hf_config, dict(sorted(constructors.items())))


# --------------------------------------------------------------------------
# Checkpoint names and weights
# --------------------------------------------------------------------------


def checkpoint_names(cfg) -> list[str]:
    """Checkpoint names to map: the shipped checkpoint's (the harness's, its
    confidence head included) plus quantization suffixes and strays."""
    names = list(drafter.checkpoint_tensors(cfg, confidence=True))
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        for proj in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"):
            names += [
                f"{p}.self_attn.{proj}.weight_scale",
                f"{p}.self_attn.{proj}.weight_packed",
                f"{p}.self_attn.{proj}.input_scale",
            ]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}.mlp.{proj}.weight_scale_inv")
        names.append(f"{p}.self_attn.rotary_emb.inv_freq")
    names += [
        "context_proj.weight_scale",
        "confidence_head.weight",
        "confidence_head.bias",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "markov_head.markov_w2.bias",
    ]
    return names


def load_checkpoint(built: Built) -> list[str]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(built.vllm_config):
        checkpoint = drafter.checkpoint_tensors(built.hf_config, confidence=True)
        loaded = built.model.load_weights(checkpoint.items())
    return sorted(loaded)


# --------------------------------------------------------------------------
# Descriptions of a built drafter
# --------------------------------------------------------------------------


_SIMPLE = (bool, int, float, str, type(None), torch.dtype)


def _layer_attributes(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """Public plain attributes of vLLM's own layers inside the drafter.

    Layers (attention, linear, norms, heads) are vLLM classes the refactor
    does not change, so any difference here is a change in how the drafter
    configured them, e.g. `o_proj.reduce_results`. The drafter's own classes
    (defined in the modules under test) may gain attributes and are skipped.
    """
    own = ("K3DSpark",)
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        if type(m).__name__.startswith(own):
            continue
        attrs = {
            k: v
            for k, v in sorted(vars(m).items())
            if not k.startswith("_") and isinstance(v, _SIMPLE)
        }
        out.append((name, attrs))
    return out


def module_tree(model: nn.Module) -> dict[str, Any]:
    return {
        "modules": [
            (name, type(m).__name__)
            for name, m in model.named_modules(remove_duplicate=False)
        ],
        "layer_attributes": _layer_attributes(model),
        "parameters": [
            (name, tuple(p.shape), p.dtype, p.requires_grad)
            for name, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [
            (name, tuple(b.shape), b.dtype)
            for name, b in model.named_buffers(remove_duplicate=False)
        ],
        "persistent_state": [
            (name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
        ],
    }


def state_values(model: nn.Module) -> dict[str, TensorValue]:
    return {name: TensorValue.of(t) for name, t in model.state_dict().items()}


def mapper_table(mapper, names: list[str]) -> dict[str, Any]:
    return {name: mapper._map_name_with_shard(name) for name in names}


# --------------------------------------------------------------------------
# Scenario: precompute_and_store_context_kv
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContextKVScenario:
    cache_dtype: str = "auto"
    # "uniform", "padded_entries" (layer 1 has larger entry and block
    # strides), "entry_stride" (layer 1 differs in entry stride only),
    # "block_size" (layer 2 has a different block size) or "mixed_dtype"
    # (layer 1 keeps an fp8 cache in a bf16 model).
    layout: str = "uniform"
    # "shared" tensor, "per_layer" list, "aliased" list (one tensor three
    # times), "with_none" list (layer 1 has no slot mapping) or "none".
    slots: str = "shared"
    # Run once against profiling caches, then bind new caches and run twice
    # more (the stale-pointer case).
    rebind: bool = False

    @property
    def id(self) -> str:
        parts = [self.cache_dtype, self.layout, self.slots]
        if self.rebind:
            parts.append("rebind")
        return "-".join(parts)


class _Labelled:
    """Names each cache bound in one allocation `<generation>/layer<i>`."""

    def __init__(self, describer: Describer, generation: str) -> None:
        self.describer, self.generation, self.count = describer, generation, 0

    def register(self, cache: torch.Tensor) -> None:
        self.describer.register_cache(f"{self.generation}/layer{self.count}", cache)
        self.count += 1


def _cache_layouts(scenario: ContextKVScenario) -> list[drafter.CacheLayout]:
    layouts = [drafter.CacheLayout(NUM_BLOCKS, BLOCK_SIZE) for _ in range(NUM_DRAFT_LAYERS)]
    if scenario.layout == "padded_entries":  # layer 1: larger entry and block strides
        layouts[1] = drafter.CacheLayout(NUM_BLOCKS, BLOCK_SIZE, padding=8)
    elif scenario.layout == "block_size":
        layouts[2] = drafter.CacheLayout(NUM_BLOCKS, BLOCK_SIZE * 2)
    elif scenario.layout == "entry_stride":
        # Every layer has padded entries, except layer 1, whose entries are
        # packed inside equally padded blocks: same block size and block
        # stride, different entry stride.
        layouts = [drafter.CacheLayout(NUM_BLOCKS, BLOCK_SIZE, padding=8, packed=i == 1)
                   for i in range(NUM_DRAFT_LAYERS)]
    return layouts


def _allocate_caches(
    log: CallLog, model: nn.Module, scenario: ContextKVScenario, generation: str
) -> None:
    generator = torch.Generator().manual_seed(1234)

    def fill(storage: torch.Tensor) -> None:
        # Non-zero contents, so every write (and every stray one) shows in the
        # final cache values.
        if storage.dtype == torch.uint8:
            storage.fill_(7)
        else:
            storage.copy_(torch.randn(storage.shape, generator=generator))

    drafter.bind_caches(
        [drafter.cache_owner(layer.self_attn) for layer in model.model.layers],
        _cache_layouts(scenario),
        registry=_Labelled(log.describer, generation),
        fill=fill,
    )


def _slot_mapping_arg(scenario: ContextKVScenario, num_tokens: int, offset: int):
    base = torch.arange(num_tokens, dtype=torch.int64) * 2 + offset
    base[1] = -1  # a padded token
    if scenario.slots == "none":
        return None
    if scenario.slots == "shared":
        return base
    if scenario.slots == "aliased":
        return [base, base, base]
    per_layer = [(base + 3 * i).clamp(min=-1) for i in range(NUM_DRAFT_LAYERS)]
    for s in per_layer:
        s[1] = -1
    if scenario.slots == "with_none":
        per_layer[1] = None
    return per_layer


def run_context_kv(module: types.ModuleType, scenario: ContextKVScenario) -> Trace:
    from vllm.config import set_current_vllm_config

    with recording() as log:
        built = build_drafter(
            module, confidence_head=False, cache_dtype=scenario.cache_dtype
        )
        model = built.model
        load_checkpoint(built)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            if scenario.layout == "mixed_dtype" and i == 1:
                attn.kv_cache_dtype = "fp8"
            # Distinct per-layer scales, so the stacked scales are checked.
            attn._k_scale.fill_(0.5 + 0.25 * i)
        cfg = built.hf_config
        generator = torch.Generator().manual_seed(99)

        def call(num_tokens: int, offset: int) -> None:
            states = torch.randn((num_tokens, cfg.hidden_size), generator=generator)
            positions = torch.randint(
                0, cfg.max_position_embeddings, (num_tokens,), generator=generator
            )
            model.precompute_and_store_context_kv(
                states.to(torch.bfloat16),
                positions,
                _slot_mapping_arg(scenario, num_tokens, offset),
            )

        with set_current_vllm_config(built.vllm_config):
            _allocate_caches(
                log, model, scenario, "profile" if scenario.rebind else "real"
            )
            # Every load ends in the post-load hooks, which build the
            # cross-layer metadata (vLLM 0.34.0 dropped the lazy build).
            model.process_weights_after_loading()
            log.trace.calls.append(("<call>", 1))
            call(5, 0)
            if scenario.rebind:
                _allocate_caches(log, model, scenario, "real")
                log.trace.calls.append(("<call>", 2))
                call(4, 1)
                log.trace.calls.append(("<call>", 3))
                call(3, 7)
        log.trace.outputs["caches"] = {
            label: TensorValue.of(cache)
            for label, cache in sorted(log.describer.caches.values())
        }
        return log.trace


# --------------------------------------------------------------------------
# Scenario: forward and the causal-LM helpers
# --------------------------------------------------------------------------


def _attention_stand_in(attn: nn.Module):
    def forward(positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        out = hidden_states.float() * 0.5
        out = out + torch.sin(positions.float()).unsqueeze(-1) * 0.1
        return out.to(hidden_states.dtype)

    return forward


def run_forward(module: types.ModuleType, *, confidence_head: bool) -> Trace:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    with recording() as log:
        built = build_drafter(module, confidence_head=confidence_head)
        model = built.model
        cfg = built.hf_config
        load_checkpoint(built)
        generator = torch.Generator().manual_seed(7)
        with set_current_vllm_config(built.vllm_config):
            model.process_weights_after_loading()
            # What load_dspark_model aliases from the target.
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
            embed.weight.data.copy_(
                torch.randn(embed.weight.shape, generator=generator) * 0.5
            )
            lm_head = ParallelLMHead(
                cfg.draft_vocab_size, cfg.hidden_size, params_dtype=torch.bfloat16
            )
            lm_head.weight.data.copy_(
                torch.randn(lm_head.weight.shape, generator=generator) * 0.2
            )
            model.model.embed_tokens = embed
            model.lm_head = lm_head

            for layer in model.model.layers:
                layer.self_attn.forward = _attention_stand_in(layer.self_attn)

            handles = []
            for name, submodule in model.named_modules():

                def hook(mod, args, kwargs, output, name=name):
                    log.trace.calls.append(
                        (
                            f"module {name or '<root>'} ({type(mod).__name__})",
                            {
                                "args": log.describer(args),
                                "kwargs": log.describer(kwargs),
                                "output": log.describer(output),
                            },
                        )
                    )

                handles.append(submodule.register_forward_hook(hook, with_kwargs=True))

            num_tokens = 6
            input_ids = torch.randint(
                0, cfg.vocab_size, (num_tokens,), generator=generator
            )
            positions = torch.arange(num_tokens) + 11
            outputs = log.trace.outputs
            with set_forward_context(None, built.vllm_config):
                hidden = model(input_ids, positions)
                outputs["forward"] = log.describer(hidden)
                embeds = model.embed_input_ids(input_ids)
                outputs["embed_input_ids"] = log.describer(embeds)
                outputs["forward(inputs_embeds)"] = log.describer(
                    model(input_ids, positions, inputs_embeds=embeds * 2)
                )
                context = torch.randn(
                    (num_tokens, cfg.target_hidden_size * cfg.num_target_layers),
                    generator=generator,
                ).to(torch.bfloat16)
                outputs["combine_hidden_states"] = log.describer(
                    model.combine_hidden_states(context)
                )
                outputs["compute_logits"] = log.describer(model.compute_logits(hidden))
                outputs["compute_draft_logits"] = log.describer(
                    model.compute_draft_logits(hidden)
                )
                outputs["map_draft_to_target"] = log.describer(
                    model.map_draft_to_target(input_ids)
                )
                markov = model.markov_embed(input_ids)
                outputs["markov_embed"] = log.describer(markov)
                outputs["markov_bias"] = log.describer(model.markov_bias(markov))
                if confidence_head:
                    outputs["compute_confidence"] = log.describer(
                        model.compute_confidence(hidden, markov)
                    )
                outputs["draft_kv_cache_layer_names"] = (
                    model.get_draft_kv_cache_layer_names()
                )
            for handle in handles:
                handle.remove()
        return log.trace


# --------------------------------------------------------------------------
# All checks, computed in one child process
# --------------------------------------------------------------------------

CONTEXT_KV_SCENARIOS = [
    ContextKVScenario("auto", "uniform", "shared"),
    ContextKVScenario("auto", "uniform", "per_layer"),
    ContextKVScenario("auto", "uniform", "aliased"),
    ContextKVScenario("auto", "uniform", "with_none"),
    ContextKVScenario("auto", "uniform", "none"),
    ContextKVScenario("auto", "padded_entries", "shared"),
    ContextKVScenario("auto", "block_size", "per_layer"),
    ContextKVScenario("auto", "entry_stride", "shared"),
    ContextKVScenario("auto", "mixed_dtype", "shared"),
    ContextKVScenario("bfloat16", "uniform", "per_layer"),
    ContextKVScenario("fp8", "uniform", "shared"),
    ContextKVScenario("fp8", "padded_entries", "shared"),
    ContextKVScenario("fp8", "uniform", "with_none"),
    ContextKVScenario("fp8_e4m3", "uniform", "aliased"),
    ContextKVScenario("fp8_e5m2", "uniform", "shared"),
    ContextKVScenario("auto", "uniform", "shared", rebind=True),
    ContextKVScenario("fp8", "uniform", "per_layer", rebind=True),
    ContextKVScenario("auto", "padded_entries", "shared", rebind=True),
]


def _built_quietly(module, confidence_head):
    with recording():
        return build_drafter(module, confidence_head=confidence_head)


def _public_names(module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in PUBLIC_NAMES:
        cls = getattr(module, name, None)
        out[name] = None if cls is None else cls.__name__
    lm = module.K3DSparkForCausalLM
    out["has_own_embed_tokens"] = lm.has_own_embed_tokens
    out["has_own_lm_head"] = lm.has_own_lm_head
    out["draft_id_to_target_id"] = lm.draft_id_to_target_id
    return out


def _mapper(module, confidence_head):
    names = checkpoint_names(
        drafter.make_hf_config(
            rope="default", confidence=confidence_head, num_layers=NUM_DRAFT_LAYERS
        )
    )
    model = _built_quietly(module, confidence_head).model
    return {
        "class": mapper_table(module.K3DSparkForCausalLM.hf_to_vllm_mapper, names),
        "instance": mapper_table(model.hf_to_vllm_mapper, names),
    }


def _load(module, confidence_head):
    with recording() as log:
        built = build_drafter(module, confidence_head=confidence_head)
        loaded = load_checkpoint(built)
        built.model.process_weights_after_loading()
        return {
            "loaded": loaded,
            "state": state_values(built.model),
            "op_calls": log.trace.calls,
        }


def _trace(trace: Trace) -> dict[str, Any]:
    return {"calls": trace.calls, "outputs": trace.outputs}


def checks() -> dict[str, Callable[[types.ModuleType], Any]]:
    out: dict[str, Callable[[types.ModuleType], Any]] = {"public_names": _public_names}
    for conf in (False, True):
        tag = "confidence" if conf else "no-confidence"
        out[f"module_tree[{tag}]"] = lambda m, c=conf: module_tree(
            _built_quietly(m, c).model
        )
        out[f"constructors[{tag}]"] = lambda m, c=conf: _built_quietly(
            m, c
        ).constructors
        out[f"mapper[{tag}]"] = lambda m, c=conf: _mapper(m, c)
        out[f"load_weights[{tag}]"] = lambda m, c=conf: _load(m, c)
        out[f"forward[{tag}]"] = lambda m, c=conf: _trace(
            run_forward(m, confidence_head=c)
        )
    for scenario in CONTEXT_KV_SCENARIOS:
        out[f"context_kv[{scenario.id}]"] = lambda m, s=scenario: _trace(
            run_context_kv(m, s)
        )
    return out


def compute_all() -> dict[str, Any]:
    """{check: ("ok", pristine result, current result) or ("error", traceback)}."""
    import traceback

    results: dict[str, Any] = {}
    with cpu_environment() as modules:
        for name, fn in checks().items():
            try:
                results[name] = (
                    "ok",
                    fn(modules["pristine"]),
                    fn(modules["current"]),
                )
            except Exception:
                results[name] = ("error", traceback.format_exc())
    return results


def main(out_path: str) -> None:
    """Child-process entry point (run via `-c`, so classes pickle by module)."""
    import pickle

    with open(out_path, "wb") as f:
        pickle.dump(compute_all(), f)
