"""Does aiter's fused RoPE + MLA cache write saturate an fp8 KV cache on AMD GPUs?

With AITER on, the ROCm drafter writes a decode batch's KV-cache rows with
aiter's Triton ``fused_qk_rope_cat_and_cache_mla``
(``K3DSparkMLAAttention._rope_and_cache_write``, ``apply_scale`` on for an fp8
cache). The kernel stores ``(x.to(fp32) * (1 / k_scale)).to(cache dtype)``.
Where vLLM's ``concat_and_cache_mla`` writes it, a value beyond the fp8 range
(240 in MI300's e4m3fnuz, 448 in MI355's OCP e4m3fn) is saturated: HIP's
``__hip_cvt_float_to_fp8`` with ``__default_saturation`` (``__HIP_SATFINITE``,
``csrc/quantization/w8a8/fp8/amd/quant_utils.cuh``) clamps with ``v_med3_f32``
before the conversion. If aiter's write did not saturate, such a value would
be stored as NaN (e4m3fnuz has no inf: 0x80), and a NaN in the draft KV cache
poisons every later draft attention over that slot: QK^T is NaN for every head
(the latent is shared), so the softmax and the draft logits are NaN.

What Triton 3.8's AMD backend makes of the kernel, compiled here for gfx942
and gfx950 at the drafter's launches (kv_lora_rank 512, rope 64, 8 and 64
heads, fp8 cache, KV storage under and over 2 GiB, both token-count
specializations), and asserted below:

1. The source has no clamp: no ``tl.clamp``/``minimum``/``maximum`` in the
   kernel or the helpers it calls.
2. Each fp32 -> fp8 conversion is the bare hardware instruction,
   ``v_cvt_pk_fp8_f32`` on gfx942 and ``v_cvt_scalef32_pk_fp8_f32`` (scale
   1.0) on gfx950, from the four cache-write casts of the source: no clamp
   modifier (LLVM's assembler rejects one on both instructions: it cannot be
   encoded), no ``v_med3_f32`` against +-max before it, and the constants
   +-240 / +-448 appear nowhere in the kernel. The patch notes' "bare
   ``v_cvt_pk_fp8_f32`` (no clamp)" is right about the instruction.
3. But the kernel's entry block, before any branch and before any
   conversion, runs ``s_setreg_imm32_b32 hwreg(HW_REG_MODE, 23, 1), 1``: MODE
   bit 23, FP16_OVFL (the kernel descriptor starts waves with
   ``.amdhsa_fp16_overflow 0``), which nothing clears afterwards. Triton emits
   it as its ``amdgcn.set.fp8.clamping`` attribute (the string is in
   libtriton.so), in every kernel that downcasts to an fp8 type and in no
   other (the controls below: an fp32 -> bf16 cast gets none). That is the
   hardware's clamp switch for fp8 conversions: with it set, an out-of-range
   value converts to +-max instead of NaN. So the notes' conclusion (NaN where
   vLLM saturates) does not follow from the instruction alone: by the compiled
   code, the write saturates on both GPUs, as vLLM's does.

What cannot be established on this machine: the hardware's own behaviour. No
ISA manual is here; what is here is AMD's own code: composable_kernel
(``ck/utility/amd_ck_fp8.hpp``) and aiter's ``hip_float8_impl.h`` and
``ck_tile/vec_convert.h`` saturate by ``v_med3``/``fmed3`` to +-240/+-448
before the same instructions (kernels that leave FP16_OVFL at 0), CK's
non-saturating mode is documented "replace with NaN or Inf" with a software
twin returning 0x80 for e4m3fnuz overflow, and ``ck/utility/mxf8_utils.hpp``
says of ``v_cvt_scalef32_pk_fp8_f32``: "If fval / scale > max fp8, returns
Nan". That the MODE bit turns this into saturation is Triton's (AMD's backend
developers') reading, which vLLM's own ``csrc/rocm/quickreduce/base.h``
confirms only as far as the bit's name (``set_fp16_ovfl``: the same
``s_setreg``). ``test_rocm_gpu_cache_write_saturates`` answers it on a GPU.

Triton's interpreter cannot: it emulates the cast on CPU. The harness routes
fp8 downcasts through torch (``exact_fp8_casts``), whose e4m3fnuz cast writes
NaN beyond 248 and whose e4m3fn cast saturates: an artifact of torch, not the
GPU (``test_interpreter_answer_is_torchs_cast_not_the_compiled_kernels``).

Each reading is shown able to fail: control kernels (a plain cast, with
``tl.clamp``, with ``minimum(maximum())``, with a one-sided ``minimum``, and
an fp32 -> bf16 cast) are told apart by the same reader, and aiter's kernel
text without its MODE write is read as writing NaN.

The compiles run in a process per GPU (Triton's JIT keeps the first target it
sees per kernel and device; aiter's kernels load through the harness's
stand-in, which this pytest process must not hold), with a fresh Triton cache:
about 10 s on 2 idle cores (25 s under load); the interpreter check about 10 s
more.
"""

from __future__ import annotations

import ast
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tests.verification.harness import aiter as aiter_harness

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.verification.test_aiter_fp8_saturation"
KERNEL = "_fused_qk_rope_cat_and_cache_mla_kernel"
KERNEL_FILE = "ops/triton/_triton_kernels/fused_kv_cache.py"
HELPER_FILES = ("ops/triton/rope.py",)  # _get_gptj/neox_rotated_x_1D
HEADS = (8, 64)
KV_LORA_RANK = 512
QK_NOPE = 128
QK_ROPE = 64


@dataclass(frozen=True)
class Fp8:
    arch: str
    torch_dtype: str  # vLLM's RocmPlatform.fp8_dtype() there
    triton_dtype: str
    max: float
    instruction: str  # the conversion Triton emits for it
    nan: tuple[int, ...]  # its NaN bytes


FP8 = {
    "gfx942": Fp8("gfx942", "float8_e4m3fnuz", "fp8e4b8", 240.0, "v_cvt_pk_fp8_f32",
                  (0x80,)),
    "gfx950": Fp8("gfx950", "float8_e4m3fn", "fp8e4nv", 448.0,
                  "v_cvt_scalef32_pk_fp8_f32", (0x7F, 0xFF)),
}

# --- reading AMDGCN -----------------------------------------------------------

# fp32/f16/bf16 -> fp8/bf8 (the other direction ends in _fp8/_bf8).
TO_FP8 = re.compile(r"^v_cvt(?:_scalef32)?(?:_pk|_sr)+_(?:fp8|bf8)_(?:f32|f16|bf16)$")
MODIFIER = re.compile(r"(?<![\[\w])[A-Za-z_]\w*:(?:\[[^\]]*\]|\S+)")  # op_sel:[0,0,1]
REGISTER = re.compile(r"^([vs])(?:(\d+)|\[(\d+):(\d+)\])$")
HWREG = re.compile(r"s_setreg(?:_imm32)?_b32\s+(?:hwreg\((\w+)(?:,\s*(\d+),\s*(\d+))?\)|"
                   r"(0x[0-9a-fA-F]+|\d+)),\s*(\S+)")
NO_WRITE = ("s_cbranch", "s_branch", "s_waitcnt", "s_endpgm", "s_setreg", "s_nop",
            "global_store", "buffer_store", "flat_store", "scratch_store", "ds_write",
            "ds_store", "s_store", "s_barrier")
FP16_OVFL_BIT = 23  # of HW_REG_MODE
HW_REG_MODE = 1


@dataclass
class Instr:
    op: str  # mnemonic without its encoding suffix
    operands: list[str]
    modifiers: list[str]
    text: str
    loc: tuple[str, int] | None  # (file, line) of the source it came from


def instructions(asm: str) -> list[Instr]:
    """The kernel's instructions in text order, from its label to .Lfunc_end."""
    out: list[Instr] = []
    loc = None
    inside = False
    for raw in asm.splitlines():
        line = raw.strip()
        if not inside:
            inside = bool(re.match(r"^[A-Za-z_]\w*:", line))
            continue
        if line.startswith(".Lfunc_end"):
            break
        if line.startswith(".loc"):
            where = re.search(r";\s*([\w.]+):(\d+):\d+\s*$", line)
            loc = (where.group(1), int(where.group(2))) if where else None
            continue
        code = line.split(";")[0].strip()
        if not code or code.startswith(".") or code.endswith(":"):
            continue
        op, rest = (code.split(None, 1) + [""])[:2]
        op = re.sub(r"_(?:e32|e64|sdwa|dpp)$", "", op)
        if op.startswith("s_setreg"):
            out.append(Instr(op, [], [], code, loc))
            continue
        modifiers = MODIFIER.findall(rest)
        rest = MODIFIER.sub("", rest)
        operands = [p.strip() for p in rest.split(",") if p.strip()]
        if operands:
            last, *extra = operands[-1].split()
            operands[-1] = last
            modifiers += extra
        out.append(Instr(op, operands, modifiers, code, loc))
    return out


def registers(operand: str) -> set[tuple[str, int]]:
    m = REGISTER.match(operand.strip("-|"))
    if not m:
        return set()
    low = int(m.group(2) or m.group(3))
    high = int(m.group(2) or m.group(4))
    return {(m.group(1), i) for i in range(low, high + 1)}


def producer(instrs: list[Instr], at: int, operand: str) -> int | None:
    """Index of the last instruction before `at` (in text order) that wrote
    `operand`."""
    wanted = registers(operand)
    for i in range(at - 1, -1, -1):
        ins = instrs[i]
        if ins.operands and not ins.op.startswith(NO_WRITE) and registers(ins.operands[0]) & wanted:
            return i
    return None


def constant(instrs: list[Instr], at: int, operand: str) -> float | None:
    """An operand's value when it is a float literal or a register a move
    filled with one; else None."""
    text = operand.strip()
    negate = text.startswith("-")
    text = text.lstrip("-")
    value = None
    if re.fullmatch(r"0x[0-9a-fA-F]{1,8}", text):
        value = struct.unpack("<f", struct.pack("<I", int(text, 16)))[0]
    elif re.fullmatch(r"\d+\.\d+", text):
        value = float(text)
    elif registers(text):
        i = producer(instrs, at, text)
        if i is not None and instrs[i].op in ("v_mov_b32", "s_mov_b32") \
                and len(instrs[i].operands) == 2:
            value = constant(instrs, i, instrs[i].operands[1])
    if value is None:
        return None
    return -value if negate else value


def value_sources(ins: Instr) -> list[str]:
    """The operands a conversion converts (not its scale or random bits)."""
    return ins.operands[1:3] if "_pk_" in ins.op else ins.operands[1:2]


def explicitly_clamped(instrs: list[Instr], at: int, fmax: float) -> bool:
    """Every value the conversion at `at` converts comes from v_med3_f32
    against -fmax and +fmax (what tl.clamp and minimum(maximum()) become)."""
    sources = value_sources(instrs[at])
    if not sources:
        return False
    for operand in sources:
        i = producer(instrs, at, operand)
        if i is None or instrs[i].op != "v_med3_f32":
            return False
        bounds = {constant(instrs, i, o) for o in instrs[i].operands[1:]}
        if not {fmax, -fmax} <= bounds:
            return False
    return True


def _mode_write(ins: Instr) -> int | None | str:
    """What an s_setreg writes to MODE bit 23: 0, 1, None (not that bit) or
    'unknown' (a register value)."""
    m = HWREG.search(ins.text)
    if not m:
        return "unknown"
    name, offset, size, imm, value = m.groups()
    if imm is not None:
        code = int(imm, 0)
        reg, offset, size = code & 63, (code >> 6) & 31, ((code >> 11) & 31) + 1
    else:
        reg = HW_REG_MODE if name == "HW_REG_MODE" else -1
        offset, size = (int(offset), int(size)) if offset is not None else (0, 32)
    if reg != HW_REG_MODE or not offset <= FP16_OVFL_BIT < offset + size:
        return None
    if not re.fullmatch(r"0x[0-9a-fA-F]+|\d+", value):
        return "unknown"
    return (int(value, 0) >> (FP16_OVFL_BIT - offset)) & 1


def fp8_clamp_mode(asm: str, instrs: list[Instr], at: int) -> bool:
    """MODE bit 23 (FP16_OVFL, Triton's amdgcn.set.fp8.clamping) is set when
    the instruction at `at` runs: the descriptor's start value, then the
    s_setreg writes before it, the first of them in the entry block (before
    any branch) and none clearing it after."""
    start = re.search(r"\.amdhsa_fp16_overflow\s+(\d)", asm)
    state: int | str = int(start.group(1)) if start else 0
    branched = False
    for ins in instrs[:at]:
        if ins.op.startswith("s_cbranch"):
            branched = True
        if ins.op.startswith("s_setreg"):
            written = _mode_write(ins)
            if written is None:
                continue
            if branched and written == 1 and state != 1:
                return False  # set on some paths only: not read as set
            state = written
    return state == 1


def max_constants(asm: str, fmax: float) -> list[str]:
    """Lines of the kernel that name +-fmax as an fp32 literal."""
    words = {f"0x{struct.unpack('<I', struct.pack('<f', v))[0]:x}" for v in (fmax, -fmax)}
    return [i.text for i in instructions(asm) if words & set(re.findall(r"0x[0-9a-f]+", i.text))]


@dataclass
class Conversion:
    instr: Instr
    clamped: bool  # explicitly, by v_med3 against +-max
    clamp_mode: bool  # MODE bit 23 set

    @property
    def verdict(self) -> str:
        if self.clamped:
            return "clamped"
        return "clamp mode" if self.clamp_mode else "NaN"


def conversions(asm: str, fmax: float) -> list[Conversion]:
    instrs = instructions(asm)
    return [Conversion(ins, explicitly_clamped(instrs, i, fmax), fp8_clamp_mode(asm, instrs, i))
            for i, ins in enumerate(instrs) if TO_FP8.match(ins.op)]


def without_mode_writes(asm: str) -> str:
    return "\n".join(line for line in asm.splitlines() if "s_setreg" not in line)


# --- reading the kernel source --------------------------------------------------

CLAMPS = {"clamp", "minimum", "maximum", "fmin", "fmax", "clip"}


def _functions(paths: list[Path]) -> dict[str, ast.FunctionDef]:
    found = {}
    for path in paths:
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = node
    return found


def _called(node: ast.AST) -> list[str]:
    return [n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(node) if isinstance(n, ast.Call)
            and isinstance(n.func, (ast.Name, ast.Attribute))]


def clamp_calls(functions: dict[str, ast.FunctionDef], root: str) -> list[str]:
    """Clamp-like calls in `root` and the functions it calls (transitively)."""
    seen, todo, found = set(), [root], []
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        calls = _called(functions[name])
        found += [f"{name}: {c}" for c in calls if c in CLAMPS]
        todo += calls
    return found


def cache_casts(kernel: ast.FunctionDef) -> list[tuple[int, int]]:
    """Line spans of the kernel's `.to(kv_cache_ptr.dtype.element_ty)` casts."""
    return [(n.lineno, n.end_lineno) for n in ast.walk(kernel)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "to" and n.args
            and ast.unparse(n.args[0]) == "kv_cache_ptr.dtype.element_ty"]


# --- the kernels compiled in the worker ----------------------------------------

NO_CLAMP, CLAMP, MIN_MAX, ONE_SIDED = 0, 1, 2, 3


@triton.jit
def _control_kernel(x_ptr, scale_ptr, y_ptr, HOW: tl.constexpr, FMAX: tl.constexpr,
                    BLOCK: tl.constexpr):
    # aiter's cache write: bf16 in, times 1 / k_scale in fp32, cast to the
    # output's dtype; 4 values a lane (BLOCK 256, one wave): two full packed
    # conversions, none padded with an undefined half.
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.float32) * (1 / tl.load(scale_ptr)).to(tl.float32)
    if HOW == 1:
        x = tl.clamp(x, -FMAX, FMAX)
    elif HOW == 2:
        x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    elif HOW == 3:
        x = tl.minimum(x, FMAX)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty))


@triton.jit
def _asm_kernel(x_ptr, y_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    y = tl.inline_asm_elementwise(ASM, "=v,v", [tl.load(x_ptr + offs)], dtype=tl.int32,
                                  is_pure=True, pack=1)
    tl.store(y_ptr + offs, y)


CONTROLS = {"plain": (NO_CLAMP, "fp8"), "clamp": (CLAMP, "fp8"), "min_max": (MIN_MAX, "fp8"),
            "one_sided": (ONE_SIDED, "fp8"), "bf16": (NO_CLAMP, "bf16")}


def _stderr_of(compile_) -> tuple[bool, str]:
    """(compiled, what LLVM printed to fd 2) of one compile."""
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            try:
                compile_()
                ok = True
            except Exception:  # the assembler's error surfaces as a failed link
                ok = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return ok, log.read().decode(errors="replace")


def _compile_worker(arch_name: str, out: Path) -> None:
    """Compile, for one GPU, aiter's kernel at the drafter's fp8 launches, the
    controls and the clamp-modifier probe; write the AMDGCN and index.json."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from scripts.perf.amd_resources import shapes
    from scripts.perf.amd_resources.kernel_tree import _RocmDriver
    from scripts.perf.amd_resources.resources import variant_key
    from scripts.perf.amd_resources.targets import arch_named

    fp8, arch = FP8[arch_name], arch_named(arch_name)
    target = GPUTarget("hip", arch_name, 64)
    triton.runtime.driver.set_active(_RocmDriver(arch))
    index: dict = {"aiter": [], "controls": {}, "probe": {}}

    groups: dict[tuple, list] = {}
    for launch in shapes.aiter_fused_rope_launches(arch):
        if launch.shape["kv"] == "fp8" and launch.shape["heads"] in HEADS:
            groups.setdefault(variant_key(launch), []).append(launch)
    for i, group in enumerate(groups.values()):
        launch = group[0]
        compiled = launch.kernel.run(*launch.args, grid=launch.grid, warmup=True,
                                     **launch.kwargs)
        name = f"aiter-{i}.s"
        (out / name).write_text(compiled.asm["amdgcn"])
        shape = dict(launch.shape)
        index["aiter"].append({"file": name, "shape": shape,
                               "tokens": sorted(x.shape["tokens"] for x in group)})

    for name, (how, out_dtype) in CONTROLS.items():
        y = "*" + (fp8.triton_dtype if out_dtype == "fp8" else "bf16")
        source = ASTSource(_control_kernel, {"x_ptr": "*bf16", "scale_ptr": "*fp32", "y_ptr": y},
                           {"HOW": how, "FMAX": fp8.max, "BLOCK": 256})
        compiled = triton.compile(source, target=target, options={"num_warps": 1})
        (out / f"control-{name}.s").write_text(compiled.asm["amdgcn"])
        index["controls"][name] = f"control-{name}.s"

    scale = ", 1.0" if "scalef32" in fp8.instruction else ""
    for name, asm in (("bare", f"{fp8.instruction} $0, $1, $1{scale}"),
                      ("clamp", f"{fp8.instruction} $0, $1, $1{scale} clamp")):
        source = ASTSource(_asm_kernel, {"x_ptr": "*fp32", "y_ptr": "*i32"},
                           {"ASM": asm, "BLOCK": 64})
        ok, stderr = _stderr_of(lambda: triton.compile(source, target=target,
                                                       options={"num_warps": 1}))
        index["probe"][name] = {"asm": asm, "compiled": ok, "stderr": stderr[-2000:]}
    (out / "index.json").write_text(json.dumps(index, indent=1))


# --- the functional check (a ROCm GPU, or Triton's interpreter) ----------------


def _beyond_range_job(case: tuple[str, str, float]) -> dict:
    """One launch of aiter's kernel as the drafter makes it (8 heads, 4 tokens,
    q split into nope/rope, fp32 cos/sin halves, GPT-J rotation, apply_scale)
    with cache values beyond the fp8 range. cos 1 and sin 0 leave k_pe as is,
    so every cache value is the input over k_scale. Returns the written rows'
    bytes and the values they should hold."""
    device, fp8_name, k_scale = case
    fp8 = getattr(torch, fp8_name)
    fmax = torch.finfo(fp8).max
    tokens, heads, max_pos = 4, 8, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, QK_NOPE + QK_ROPE, generator=gen).bfloat16()
    # In range (|randn| < 10 always), but for the rows' planted values.
    k_nope = torch.randn(tokens, 1, KV_LORA_RANK, generator=gen) * 0.1 * fmax * k_scale
    k_pe = torch.randn(tokens, 1, QK_ROPE, generator=gen) * 0.1 * fmax * k_scale
    beyond = torch.tensor([1.5, -1.5, 3.0, -3.0, 40.0, -40.0, 1.1, -1.1]) * fmax * k_scale
    k_nope[0, 0, :8] = beyond
    k_nope[1, 0, -8:] = beyond
    k_pe[2, 0, :8] = beyond
    k_pe[3, 0, -8:] = beyond
    k_nope, k_pe = k_nope.bfloat16(), k_pe.bfloat16()
    cos = torch.ones(max_pos, QK_ROPE // 2)
    sin = torch.zeros(max_pos, QK_ROPE // 2)
    positions = torch.arange(tokens) + 3
    slots = torch.tensor([5, 0, 17, 9])
    cache = torch.zeros(32, 1, KV_LORA_RANK + QK_ROPE, dtype=fp8)
    scale = torch.tensor([k_scale], dtype=torch.float32)
    if device == "interpreter":
        fn = aiter_harness.fused_qk_rope_cat_and_cache_mla()
        on = "cpu"
    else:
        aiter_harness.install_stand_in()
        from aiter.ops.triton.fused_kv_cache import fused_qk_rope_cat_and_cache_mla as fn
        on = device
    args = [t.to(on) for t in (q[:, :, :QK_NOPE], q[:, :, QK_NOPE:], k_nope, k_pe, cache,
                               slots, positions, cos, sin, scale)]
    q_out = args[0].new_empty(tokens, heads, QK_NOPE + QK_ROPE)
    _, _, _, written = fn(*args[:10], False, apply_scale=True, q_out=q_out)
    rows = torch.cat([k_nope.float(), k_pe.float()], dim=-1)[:, 0] / k_scale
    return {"bytes": written.cpu()[slots, 0].view(torch.uint8).tolist(),
            "values": rows.tolist(), "fmax": fmax}


def _gpu_worker(out: Path) -> None:
    props = torch.cuda.get_device_properties(0)
    arch = props.gcnArchName.split(":")[0]
    results = {"arch": arch, "cases": {}}
    for k_scale in (1.0, 0.5):
        results["cases"][str(k_scale)] = _beyond_range_job(("cuda", FP8[arch].torch_dtype,
                                                            k_scale))
    (out / "gpu.json").write_text(json.dumps(results))


def _saturated_bytes(values: list, fp8: torch.dtype) -> list:
    """What vLLM's saturating write stores: clamp to +-max, then round."""
    fmax = torch.finfo(fp8).max
    return torch.tensor(values).clamp(-fmax, fmax).to(fp8).view(torch.uint8).tolist()


def _run(*args: str, timeout: int = 900, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- fixtures ---------------------------------------------------------------------


@dataclass
class Compiled:
    fp8: Fp8
    aiter: list[tuple[dict, str]]  # (index entry, AMDGCN)
    controls: dict[str, str]
    probe: dict[str, dict]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Compiled]:
    root = tmp_path_factory.mktemp("fp8-saturation")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TRITON_INTERPRET", None)
    workers = {}
    for arch in FP8:
        out = root / arch
        out.mkdir()
        workers[arch] = out, subprocess.Popen(
            [sys.executable, "-m", MODULE, "compile", arch, str(out)], cwd=ROOT,
            env={**env, "TRITON_CACHE_DIR": str(out / "triton-cache")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = {}
    for arch, (out, worker) in workers.items():
        stdout, stderr = worker.communicate(timeout=900)
        assert worker.returncode == 0, (stdout + stderr)[-6000:]
        index = json.loads((out / "index.json").read_text())
        found[arch] = Compiled(
            FP8[arch], [(entry, (out / entry["file"]).read_text()) for entry in index["aiter"]],
            {name: (out / f).read_text() for name, f in index["controls"].items()},
            index["probe"])
    return found


@pytest.fixture(scope="module")
def aiter_source() -> tuple[dict[str, ast.FunctionDef], Path]:
    folder = aiter_harness.installed_folder()
    path = folder / KERNEL_FILE
    return _functions([path, *(folder / f for f in HELPER_FILES)]), path


# --- the tests ----------------------------------------------------------------------


def test_aiter_kernel_source_casts_to_the_cache_dtype_without_a_clamp(aiter_source):
    """The kernel stores (x.to(fp32) * (1 / k_scale)).to(cache dtype) for
    k_nope and k_pe, on both of its paths (decode rows and the extra K rows),
    and neither it nor a helper it calls clamps anything."""
    functions, _ = aiter_source
    assert len(cache_casts(functions[KERNEL])) == 4
    assert clamp_calls(functions, KERNEL) == []
    # The reader sees a clamp where there is one.
    mine = _functions([Path(__file__)])
    assert sorted(clamp_calls(mine, "_control_kernel")) == [
        "_control_kernel: clamp", "_control_kernel: maximum", "_control_kernel: minimum",
        "_control_kernel: minimum"]


@pytest.mark.parametrize("arch", list(FP8))
def test_reader_tells_clamped_bare_and_mode_clamped_conversions_apart(compiled, arch):
    """Controls: Triton's plain fp32 -> fp8 cast is the bare instruction under
    the MODE clamp; tl.clamp and minimum(maximum()) become v_med3 against
    +-max before it; a one-sided minimum is no clamp; an fp32 -> bf16 cast has
    no fp8 conversion and no MODE write. Without its MODE write, the plain
    cast reads as writing NaN."""
    c = compiled[arch]
    fmax = c.fp8.max
    verdicts = {name: [x.verdict for x in conversions(asm, fmax)]
                for name, asm in c.controls.items()}
    assert verdicts == {"plain": ["clamp mode"] * 2, "clamp": ["clamped"] * 2,
                        "min_max": ["clamped"] * 2, "one_sided": ["clamp mode"] * 2,
                        "bf16": []}
    for name in ("plain", "clamp", "min_max", "one_sided"):
        assert {x.instr.op for x in conversions(c.controls[name], fmax)} == {c.fp8.instruction}
        assert [x.verdict for x in conversions(without_mode_writes(c.controls[name]), fmax)] \
            == (["clamped"] * 2 if name in ("clamp", "min_max") else ["NaN"] * 2)
    assert max_constants(c.controls["plain"], fmax) == []
    assert max_constants(c.controls["clamp"], fmax)
    # The MODE write comes with fp8 downcasts only.
    assert "s_setreg" in c.controls["plain"] and "s_setreg" not in c.controls["bf16"]


def test_triton_names_its_mode_write_fp8_clamping():
    """The MODE write is Triton's ``amdgcn.set.fp8.clamping`` attribute
    (``triton::amdgpu::SetFP8ClampingAttr``): its name is in libtriton.so."""
    import mmap

    library = Path(triton.__file__).parent / "_C" / "libtriton.so"
    with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m.find(b"amdgcn.set.fp8.clamping") >= 0
        assert m.find(b"SetFP8ClampingAttr") >= 0


@pytest.mark.parametrize("arch", list(FP8))
def test_the_conversion_has_no_clamp_modifier_to_set(compiled, arch):
    """LLVM's assembler takes the instruction bare and rejects a `clamp`
    modifier on it: code compiled through LLVM (Triton, HIP) can saturate only
    by clamping first (v_med3) or by the MODE bit."""
    probe = compiled[arch].probe
    assert probe["bare"]["compiled"], probe["bare"]["stderr"]
    assert not probe["clamp"]["compiled"]
    assert "invalid operand for instruction" in probe["clamp"]["stderr"]
    assert "clamp" in probe["clamp"]["stderr"]


@pytest.mark.parametrize("arch", list(FP8))
def test_aiter_cache_write_saturates_by_the_mode_bit_not_by_a_clamp(compiled, aiter_source,
                                                                      arch, record_property):
    """Every fp32 -> fp8 conversion of aiter's kernel, at every compile of the
    drafter's fp8 launches (8 and 64 heads, KV storage under and over 2 GiB,
    token counts divisible by 16 or not), is the arch's bare instruction from
    one of the four cache-write casts, with no clamp before it and +-max
    nowhere in the kernel; each runs with MODE bit 23 set by the kernel's
    entry block. Without that MODE write, each would write NaN beyond the
    range."""
    c = compiled[arch]
    functions, path = aiter_source
    cast_lines = {line for lo, hi in cache_casts(functions[KERNEL]) for line in range(lo, hi + 1)}
    variants = {(e["shape"]["heads"], e["shape"]["kv_storage"], e["tokens"][0] % 16 == 0)
                for e, _ in c.aiter}
    assert variants == {(h, s, d) for h in HEADS for s in ("KV<2G", "KV>2G")
                        for d in (False, True)}
    for entry, asm in c.aiter:
        where = f"{arch} {entry['shape']}"
        assert f'.amdgcn_target "amdgcn-amd-amdhsa--{arch}"' in asm, where
        found = conversions(asm, c.fp8.max)
        # k_nope (8 values a lane) and k_pe (1) on each of the two paths.
        assert len(found) >= 4, where
        for x in found:
            assert x.instr.op == c.fp8.instruction, (where, x.instr.text)
            if "scalef32" in x.instr.op:
                assert x.instr.operands[3] == "1.0", (where, x.instr.text)
            assert x.instr.loc is not None and x.instr.loc[0] == path.name, (where, x.instr.loc)
            assert x.instr.loc[1] in cast_lines, (where, x.instr.loc)
            assert "clamp" not in x.instr.modifiers, (where, x.instr.text)
            assert x.verdict == "clamp mode", (where, x.instr.text)
        assert max_constants(asm, c.fp8.max) == [], where
        mode_writes = [i.text for i in instructions(asm) if i.op.startswith("s_setreg")]
        assert mode_writes == ["s_setreg_imm32_b32 hwreg(HW_REG_MODE, 23, 1), 1"], where
        assert re.search(r"\.amdhsa_fp16_overflow\s+0", asm), where
        assert {x.verdict for x in conversions(without_mode_writes(asm), c.fp8.max)} == {"NaN"}
    record_property(f"measure:{arch} aiter RoPE + cache fp8 compiles, conversions each",
                    f"{len(c.aiter)}, "
                    f"{sorted({len(conversions(a, c.fp8.max)) for _, a in c.aiter})}")


def test_interpreter_answer_is_torchs_cast_not_the_compiled_kernels():
    """Under Triton's interpreter (the harness's MI300 workers), the same
    launch writes NaN (0x80) for every value beyond 240, where the compiled
    kernel runs with the hardware clamp on: the interpreter's fp8 cast is
    torch's (harness ``exact_fp8_casts``), whose e4m3fnuz overflow is NaN. In
    range it agrees with the saturating write. Don't use it for this
    question."""
    with aiter_harness.interpreter_pool("gfx942") as pool:
        got = pool.map(_beyond_range_job, [("interpreter", "float8_e4m3fnuz", 1.0)])[0]
    fp8 = torch.float8_e4m3fnuz
    values = torch.tensor(got["values"])
    beyond = values.abs() >= 248  # rounds past 240
    written = torch.tensor(got["bytes"])
    assert beyond.sum() == 32
    assert (written[beyond] == 0x80).all()
    saturated = torch.tensor(_saturated_bytes(got["values"], fp8))
    assert (written[~beyond] == saturated[~beyond]).all()
    assert not (saturated[beyond] == 0x80).any()


def _rocm_gpu() -> bool:
    return torch.version.hip is not None and torch.cuda.is_available()


@pytest.mark.skipif(not _rocm_gpu(), reason="needs a ROCm GPU (MI300 or MI355)")
def test_rocm_gpu_cache_write_saturates(tmp_path):
    """On the GPU, the answer itself: aiter's kernel writes +-max, as vLLM's
    concat_and_cache_mla does, for cache values beyond the fp8 range (k_scale
    1 and 0.5), and no NaN byte. Fails if the hardware ignores the MODE bit."""
    result = _run("gpu", str(tmp_path), timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    fp8 = FP8[data["arch"]]
    for k_scale, got in data["cases"].items():
        want = _saturated_bytes(got["values"], getattr(torch, fp8.torch_dtype))
        nan = [i for row in got["bytes"] for i, b in enumerate(row) if b in fp8.nan]
        assert nan == [], f"k_scale {k_scale}: NaN written at {nan}"
        assert got["bytes"] == want, f"k_scale {k_scale}"


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        _compile_worker(sys.argv[2], Path(sys.argv[3]))
    elif sys.argv[1] == "gpu":
        _gpu_worker(Path(sys.argv[2]))
    else:
        raise SystemExit(f"usage: python -m {MODULE} compile ARCH OUT | gpu OUT")
