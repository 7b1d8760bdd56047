"""A tiny synthetic K3 DSpark draft: config, checkpoint, construction, caches.

Runs inside an emulated process (see ``platform.activate``). The drafter class
is whatever the platform resolves (``platform_module``): the NVIDIA module
everywhere in pristine 0.34.0, the AMD module on ROCm once the stack lands.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

# Small but structurally faithful: q-LoRA, rope 16 (interleaved pairs), 2 draft
# layers, 4 heads. Vocab is a multiple of 64 so no head is padded.
DIMS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    vocab_size=128,
    markov_rank=8,
    target_hidden_size=40,
    target_layer_ids=[1, 3],
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
TARGET_LAYERS = 7  # start_layer_id of the draft layers
YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 50000.0}


def make_hf_config(
    *,
    rope: str = "yarn",
    confidence: bool = True,
    num_layers: int = 2,
    **overrides,
):
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    kw = dict(DIMS)
    kw.update(
        num_hidden_layers=num_layers,
        num_target_layers=len(DIMS["target_layer_ids"]),
        rope_parameters=dict(YARN if rope == "yarn" else DEFAULT_ROPE),
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence,
        hidden_act="silu",
        architectures=["K3DSparkModel"],
        torch_dtype="bfloat16",
    )
    kw.update(overrides)
    return K3DSparkConfig(**kw)


def checkpoint_tensors(cfg, seed: int = 0, *, confidence: bool | None = None
                       ) -> dict[str, torch.Tensor]:
    """Synthetic weights under the released checkpoint's names (layer-local
    indices, q_a/kv_a and gate/up unfused, target embedding + LM head included
    because the shipped checkpoint carries them). Every tensor is random and
    nonzero, so a parameter left at its init value is detectable. The
    confidence head's weights are there if ``cfg`` builds one, or as
    ``confidence`` says (the shipped checkpoint has them either way)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        fan_in = shape[-1]
        s = scale if scale is not None else fan_in**-0.5
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)

    H, V = cfg.hidden_size, cfg.vocab_size
    nh, dn, dr, dv = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    t: dict[str, torch.Tensor] = {
        "embed_tokens.weight": w(V, H, scale=1.0),
        "lm_head.weight": w(V, H),
        "context_proj.weight": w(H, cfg.target_hidden_size * cfg.num_target_layers),
        "context_norm.weight": norm(H),
        "final_norm.weight": norm(H),
        "markov_head.markov_w1.weight": w(V, cfg.markov_rank, scale=1.0),
        "markov_head.markov_w2.weight": w(V, cfg.markov_rank),
    }
    if getattr(cfg, "enable_confidence_head", False) if confidence is None else confidence:
        with_markov = getattr(cfg, "confidence_head_with_markov", False) or confidence
        in_dim = H + (cfg.markov_rank if with_markov else 0)
        t["confidence_head.proj.weight"] = w(1, in_dim)
        t["confidence_head.proj.bias"] = w(1, scale=0.5)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_a_proj.weight": w(cfg.q_lora_rank, H),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(cfg.kv_lora_rank + dr, H),
            p + "self_attn.q_a_layernorm.weight": norm(cfg.q_lora_rank),
            p + "self_attn.kv_a_layernorm.weight": norm(cfg.kv_lora_rank),
            p + "self_attn.q_b_proj.weight": w(nh * (dn + dr), cfg.q_lora_rank),
            p + "self_attn.kv_b_proj.weight": w(nh * (dn + dv), cfg.kv_lora_rank),
            p + "self_attn.o_proj.weight": w(H, nh * dv),
            p + "mlp.gate_proj.weight": w(cfg.intermediate_size, H),
            p + "mlp.up_proj.weight": w(cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": w(H, cfg.intermediate_size),
        }
    return t


def write_checkpoint(cfg, path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(cfg, seed)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg.save_pretrained(path)
    return tensors


def read_checkpoint(path: str):
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            yield name, f.get_tensor(name)


_DIST = {"ready": False, "workspace": False}


def init_dist(world_size: int = 1, rank: int = 0, init_file: str | None = None) -> None:
    """Join a gloo world of ``world_size`` CPU processes, all of it one
    tensor-parallel group (a no-op once joined; ``leave_dist`` first to switch).
    Every rank passes the same ``init_file``; a single rank may omit it."""
    if _DIST["ready"]:
        return
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    if init_file is None:
        with tempfile.NamedTemporaryFile(delete=False) as f:
            init_file = f.name
    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"file://{init_file}",
        local_rank=rank,
        backend="gloo",
    )
    initialize_model_parallel(world_size, 1)
    if not _DIST["workspace"]:
        from vllm.v1.worker.workspace import init_workspace_manager

        # The GPU model runner does this; the context-KV path takes scratch from it.
        init_workspace_manager(torch.device("cpu"))
        _DIST["workspace"] = True
    _DIST["ready"] = True


def leave_dist() -> None:
    """Tear down the world ``init_dist`` joined (never in a forked child: the
    process groups' threads live in the process that created them)."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    _DIST["ready"] = False


class _ConfigStub(SimpleNamespace):
    """Stand-in for a sub-config the drafter's layers only glance at. Unknown
    fields read as None (recorded in ``unknown``) instead of raising."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.__dict__.setdefault("unknown", set()).add(name)
        return None


def make_vllm_config(
    hf_config,
    *,
    cache_dtype: str = "auto",
    block_size: int = 16,
    eager: bool = False,
    custom_ops: list[str] | None = None,
):
    """``eager``: as with ``--enforce-eager`` (no torch.compile, so vLLM's custom
    ops and C++ kernels are on); otherwise vLLM's default compilation config.
    ``custom_ops``: the compilation config's (``["none"]``: every layer's
    plain-torch body)."""
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
    )

    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        compilation_config=CompilationConfig(
            mode=CompilationMode.NONE if eager else None,
            **({"custom_ops": custom_ops} if custom_ops is not None else {}),
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=256,
            is_encoder_decoder=False,
        ),
    )
    draft_model_config = _ConfigStub(
        hf_config=hf_config,
        hf_text_config=hf_config,
        quantization=None,
        dtype=torch.bfloat16,
        model="synthetic/k3-dspark",
        max_model_len=256,
    )
    target_model_config = _ConfigStub(
        get_total_num_hidden_layers=lambda: TARGET_LAYERS,
        dtype=torch.bfloat16,
        hf_config=hf_config,
        hf_text_config=hf_config,
        max_model_len=256,
        quantization=None,
        is_encoder_decoder=False,
        use_mla=True,
        uses_mrope=False,
        enforce_eager=True,
        is_moe=False,
        is_hybrid=False,
    )
    object.__setattr__(
        vllm_config,
        "speculative_config",
        _ConfigStub(
            draft_model_config=draft_model_config,
            method="dspark",
            num_speculative_tokens=4,
            enable_adaptive_verification=False,
            attention_backend="TRITON_MLA",
        ),
    )
    object.__setattr__(vllm_config, "model_config", target_model_config)
    return vllm_config


@dataclass
class Draft:
    model: torch.nn.Module
    vllm_config: object
    hf_config: object
    checkpoint: dict[str, torch.Tensor]
    loaded: set[str]
    caches: list[torch.Tensor] = field(default_factory=list)

    @property
    def layers(self):
        return list(self.model.model.layers)

    def cache_layers(self):
        """The modules that own each draft layer's KV cache (the seam)."""
        return [cache_owner(layer.self_attn) for layer in self.layers]


def cache_owner(self_attn):
    """NVIDIA: ``MultiHeadLatentAttention`` owns the cache itself. AMD: the
    wrapper's inner generic ``MLAAttention`` (``self_attn.mla_attn``) does."""
    return getattr(self_attn, "mla_attn", self_attn)


def drafter_class():
    """The class the registry resolves for ``K3DSparkModel`` on this platform."""
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry._try_load_model_cls("K3DSparkModel")


@contextlib.contextmanager
def config_context(vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


def build(
    *,
    rope: str = "yarn",
    confidence: bool = True,
    cache_dtype: str = "auto",
    num_layers: int = 2,
    seed: int = 0,
    cls=None,
    checkpoint_dir: str | None = None,
    eager: bool = False,
    draft_compilation=None,
) -> Draft:
    """Construct the drafter, write + load a synthetic checkpoint through the
    real ``load_weights`` / ``process_weights_after_loading``.
    ``draft_compilation``: what the loader turns the target's compilation
    config into for the draft (``dspark.utils.draft_compilation_config``)."""
    torch.set_default_dtype(torch.bfloat16)
    hf_config = make_hf_config(rope=rope, confidence=confidence, num_layers=num_layers)
    vllm_config = make_vllm_config(hf_config, cache_dtype=cache_dtype, eager=eager)
    if draft_compilation is not None:
        object.__setattr__(
            vllm_config,
            "compilation_config",
            draft_compilation(vllm_config.compilation_config),
        )
    cls = cls or drafter_class()
    with contextlib.ExitStack() as scratch:
        if checkpoint_dir is None:  # ours: gone once the weights are loaded
            checkpoint_dir = scratch.enter_context(
                tempfile.TemporaryDirectory(prefix="k3-dspark-ckpt-")
            )
        return _build_from(cls, vllm_config, hf_config, checkpoint_dir, seed)


def _build_from(cls, vllm_config, hf_config, checkpoint_dir: str, seed: int) -> Draft:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    tensors = write_checkpoint(hf_config, checkpoint_dir, seed)
    with config_context(vllm_config):
        init_dist()
        model = cls(vllm_config=vllm_config, prefix="")
        loaded = model.load_weights(read_checkpoint(checkpoint_dir))
        # As the loader runs it: every quant method, then each module's own
        # no-argument hook, children first (finalize_model_weights).
        process_weights_after_loading(
            model, vllm_config.model_config, torch.device("cpu")
        )
    return Draft(model, vllm_config, hf_config, tensors, set(loaded))


@dataclass(frozen=True)
class CacheLayout:
    """One layer's paged latent cache, bound as ``[num_blocks, 1, block_size,
    width]`` the way the runner does. ``padding`` leaves room after each entry
    (a wider entry stride); ``packed`` then packs the entries at the start of
    each padded block instead (same block stride, entry stride ``width``)."""

    num_blocks: int = 6
    block_size: int = 16
    padding: int = 0
    packed: bool = False


def sentinel_fill(storage: torch.Tensor) -> None:
    """Untouched entries stay recognisable: 0x7F bytes, or -7.0."""
    storage.fill_(0x7F if storage.dtype == torch.uint8 else -7.0)


def bind_caches(
    owners, layouts: list[CacheLayout], *, registry, fill=sentinel_fill
) -> list[torch.Tensor]:
    """Allocate, fill and bind one cache per cache-owning layer (``owners``, as
    ``cache_owner`` gives them); ``registry.register`` sees each bound cache."""
    caches = []
    for owner, layout in zip(owners, layouts, strict=True):
        width = owner.kv_lora_rank + owner.qk_rope_head_dim
        dtype = (
            torch.uint8 if owner.kv_cache_dtype.startswith("fp8") else torch.bfloat16
        )
        nb, bs = layout.num_blocks, layout.block_size
        storage = torch.empty((nb, 1, bs, width + layout.padding), dtype=dtype)
        fill(storage)
        if layout.packed:
            storage = storage.view(nb, 1, -1)[..., : bs * width].unflatten(-1, (bs, width))
        owner.bind_kv_cache(storage[..., :width])
        registry.register(owner.kv_cache)
        caches.append(owner.kv_cache)
    return caches


def allocate_caches(
    draft: Draft,
    *,
    num_blocks: int = 6,
    block_size: int = 16,
    layouts: list[tuple[int, int]] | None = None,
    registry=None,
) -> list[torch.Tensor]:
    """One paged latent cache per draft layer, registered with the emulated
    memory map (``bind_caches``); ``layouts`` optionally gives (num_blocks,
    block_size) per layer for a non-uniform layout."""
    from . import ops

    owners = draft.cache_layers()
    shapes = layouts or [(num_blocks, block_size)] * len(owners)
    draft.caches = bind_caches(
        owners,
        [CacheLayout(nb, bs) for nb, bs in shapes],
        registry=registry or ops.REGISTRY,
    )
    return draft.caches


def free_caches(draft: Draft, registry=None) -> None:
    from . import ops

    registry = registry or ops.REGISTRY
    for cache in draft.caches:
        if registry.is_live(cache):
            registry.free(cache)


def rope_mapping(rope_parameters: dict) -> tuple[str, float]:
    """Independent statement of the required RoPE mapping: (rope_type, softmax
    scale multiplier). Written from the requirements, not from vLLM."""
    rp = dict(rope_parameters)
    if rp["rope_type"] == "default":
        return "default", 1.0
    if rp.get("attention_factor") == 1.0:
        return "deepseek_llama_scaling", 1.0
    factor = rp["factor"]
    mscale = (
        1.0 if factor <= 1 else 0.1 * rp.get("mscale_all_dim", 0) * math.log(factor) + 1
    )
    return "deepseek_yarn", mscale * mscale


def warm_up() -> None:
    """Import everything a build touches (run once in the zygote)."""
    build(rope="yarn", confidence=True)
    try:
        import vllm.models.kimi_k3.amd.dspark_mla  # noqa: F401
    except ImportError:
        pass


def drafter_cls(which: str):
    """``nvidia``: the NVIDIA module; ``amd``: the ROCm module (stack step 3)."""
    import importlib

    module = importlib.import_module(f"vllm.models.kimi_k3.{which}.dspark_mla")
    return module.K3DSparkForCausalLM


def decode_metadata(num_tokens: int, seq_len: int) -> SimpleNamespace:
    """What a decode-only draft block's MLA metadata carries (one request)."""
    return SimpleNamespace(
        num_actual_tokens=num_tokens,
        num_decode_tokens=num_tokens,
        num_decodes=1,
        num_prefills=0,
        num_prefill_tokens=0,
        max_seq_len=seq_len,
        causal=False,
        prefill=None,
        decode=SimpleNamespace(
            block_table=torch.arange(6, dtype=torch.int32).view(1, 6),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        ),
    )


def context_inputs(cfg, num_tokens: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    positions = torch.randint(
        0, cfg.max_position_embeddings, (num_tokens,), generator=g
    )
    return states, positions


def distinct_slots(num_tokens: int, total: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[:num_tokens].to(torch.int64)
