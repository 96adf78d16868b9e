"""Linear layers whose weight concatenates several checkpoint tensors (q/k/v, gate/up).

One matmul instead of three saves kernel launches and Python overhead per layer, which on a small
model on CPU is a real share of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer import kernels
from infer.kernels import hugepages

# Weights of up to this many bytes also get the small-batch kernel's copy (infer/kernels/small_linear.cpp),
# used for steps of up to SMALL_ROWS rows: there oneDNN's cost per call, not the bytes, set the time.
# Without AMX the kernel's vdpbf16ps wins up to 32 rows. With AMX the kernel runs 2+ rows on tiles and
# beats oneDNN's prepacked linears up to 128 rows, so decodes and mixed steps go to it and long prefills
# stay on oneDNN, whose blocked GEMM is still faster for small-K weights at 2048 rows. Larger weights keep
# the kernel's copy alone (PrepackedLinear). Figures: docs/optimizations.md, "The small-batch linear".
SMALL_WEIGHT_BYTES = 8 * 2**20
SMALL_ROWS = 128 if kernels.cpu_has_amx() else 32


class MergedLinear(nn.Linear):
    """nn.Linear whose output rows are the concatenation of `output_sizes` checkpoint shards."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint shard `shard` ("weight" or "bias") into its rows of the merged tensor."""
        offset = sum(self.output_sizes[:shard])
        target = getattr(self, param_name).data.narrow(0, offset, self.output_sizes[shard])
        if target.shape != loaded.shape:
            expected, got = tuple(target.shape), tuple(loaded.shape)
            raise ValueError(f"shard {shard} of {param_name}: expected {expected}, got {got}")
        target.copy_(loaded)


def can_prepack(dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN does bf16 (AVX-512 BF16 / AMX): the one case where it pays."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PrepackedLinear(nn.Module):
    """A bf16 nn.Linear whose weight oneDNN has reordered once, at load, into its own blocked layout.

    F.linear hands oneDNN a plain [out, in] weight and pays for the reorder in every call; prepacked, a
    decode GEMV runs 1.5-4x faster and a prefill matmul ~1.4x (docs/optimizations.md, "Prepacked bf16
    weights for oneDNN"). In fp32 it is no faster, so it is not used.
    The packed weight is an opaque mkldnn tensor: a plain attribute, not a parameter or a buffer.

    A weight of up to SMALL_WEIGHT_BYTES also keeps a second copy in the layout of the small-batch kernel
    (`kernel_weight`, a non-persistent buffer, so weight_bytes counts it), which serves steps of up to
    SMALL_ROWS rows, where oneDNN's cost per call, not the weight's bytes, sets the time.

    A larger weight keeps the kernel's copy alone (no oneDNN copy), and every step goes to the kernel,
    with AMX (on tiles, where its sizes divide by 32) or without (vdpbf16ps): Llama-3.2-1B's linears
    were as fast as oneDNN or faster at every row count measured, 1 to 2048, and LM heads (which see one
    row per sampled sequence) at 1 to 128. The exception, a head at hundreds of rows, is asked only by
    prompt logprobs. Figures: docs/optimizations.md, "The small-batch linear".

    `gated` (prepack_linears: the gate_up projection of a SiLU MLP), with AMX: the kernel's copy alone,
    its rows interleaved so that each 32-channel tile pair holds 16 outputs' gate and up, and
    `silu_and_mul(x)` applies the activation in the tiles' epilogue (small_linear.cpp
    `small_linear_silu`) at every row count: the [rows, 2 x intermediate] product is never written
    out and read back (`bench_layer_ops.py --switch fused_silu`; docs/optimizations.md).
    """

    def __init__(self, linear: nn.Linear, tied: bool = False, gated: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # weights it holds that no parameter of the model still counts (a tied head's are the embedding's)
        self.num_packed_params = 0 if tied else self.in_features * self.out_features
        if isinstance(linear, MergedLinear):
            self.output_sizes = linear.output_sizes  # the model splits the output by them
        weight = linear.weight.detach()
        self.bias = linear.bias
        small = weight.nbytes <= SMALL_WEIGHT_BYTES
        amx = kernels.cpu_has_amx()
        tiles = self.out_features % 32 == 0 and self.in_features % 32 == 0 and amx
        fits = (small or tiles or not amx) and self.out_features % 16 == 0 and self.in_features % 2 == 0
        self._ops = kernels.bf16_ops() if fits else None
        # a gate_up projection whose SiLU-and-multiply the tiles apply as they go (`silu_and_mul`)
        self.fused_silu = gated and tiles and self._ops is not None
        if self.fused_silu:
            weight = interleave_gate_up(weight)
            if linear.bias is not None:
                self.bias = nn.Parameter(interleave_gate_up(linear.bias.detach()))
        kernel_weight = pack_pairs(weight) if self._ops is not None else None
        self.register_buffer("kernel_weight", kernel_weight, persistent=False)
        only = self._ops is not None and (self.fused_silu or not small)
        self.packed_weight = None if only else torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        ops = kernels.load()  # its onednn_linear is oneDNN's call in a form a decode graph can replay
        self._onednn = ops.onednn_linear if ops is not None else _onednn_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self._ops is not None and (self.packed_weight is None or flat.shape[0] <= SMALL_ROWS):
            out = self._ops.small_linear(flat.contiguous(), self.kernel_weight, self.bias)
            if self.fused_silu:  # the kernel's channels are interleaved: back to gate | up
                out = out.view(-1, self.out_features // 32, 2, 16).transpose(1, 2).reshape(out.shape)
        else:
            out = self._onednn(flat, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def act_forward(self, x: torch.Tensor, post_op: str) -> torch.Tensor | None:
        """The activation ONEDNN_POST_OPS[post_op] of self(x) from oneDNN's GEMM epilogue where oneDNN
        serves x's rows (more than SMALL_ROWS, a packed weight), else None."""
        flat = x.reshape(-1, self.in_features)
        if self.packed_weight is None or (self._ops is not None and flat.shape[0] <= SMALL_ROWS):
            return None
        name, algorithm = ONEDNN_POST_OPS[post_op]
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, name, [], algorithm)
        return out.view(*x.shape[:-1], self.out_features)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """self(x) + residual from oneDNN's GEMM epilogue where oneDNN serves x's rows, else None."""
        flat = x.reshape(-1, self.in_features)
        if self.packed_weight is None or (self._ops is not None and flat.shape[0] <= SMALL_ROWS):
            return None
        if residual.dtype != flat.dtype or residual.shape[-1] != self.out_features:
            return None
        other = residual.reshape(-1, self.out_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise.binary(flat, other, self.packed_weight, self.bias, "add")
        return out.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate_up projection of x, in one kernel pass (`fused_silu` only):
        the same values as the layer's gated_act(F.silu, self(x))."""
        flat = x.reshape(-1, self.in_features).contiguous()
        out = self._ops.small_linear_silu(flat, self.kernel_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features // 2)


# oneDNN's post-op names and algorithms of the activations an encoder's MLP applies after its first linear
ONEDNN_POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def onednn_post_op(act) -> str | None:
    """The ONEDNN_POST_OPS key of activation `act` (infer.layers.activations), or None."""
    if act is F.gelu:
        return "gelu"
    if act is F.relu:
        return "relu"
    keywords = getattr(act, "keywords", None)
    if getattr(act, "func", None) is F.gelu and keywords == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


def linear_act(linear: nn.Module, act, x: torch.Tensor) -> torch.Tensor:
    """act(linear(x)); a PrepackedLinear whose rows go to oneDNN applies the activation in the GEMM's
    epilogue (a post-op), so the [rows, out] product is not written out and read back by a second pass:
    BGE-small's 2048 x 1536 GELU took ~12% of its encoder's time apart."""
    post_op = onednn_post_op(act)
    if isinstance(linear, PrepackedLinear) and post_op is not None:
        out = linear.act_forward(x, post_op)
        if out is not None:
            return out
    return act(linear(x))


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual; a PrepackedLinear whose rows go to oneDNN adds the residual in the GEMM's
    epilogue (a binary post-op): one parallel region and one pass over the output fewer per sublayer
    of a post-LN encoder (BERT's)."""
    if isinstance(linear, PrepackedLinear):
        out = linear.add_forward(x, residual)
        if out is not None:
            return out
    return linear(x) + residual


def _onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """A [gate | up] weight (or bias) -> its rows as 16 gate channels, the same 16 up channels, the next
    16 gate channels...: each 32-channel pair of the AMX kernel then holds one output's gate and up."""
    half = t.shape[0] // 2
    gate, up = t[:half].reshape(half // 16, 16, -1), t[half:].reshape(half // 16, 16, -1)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> oneDNN's layout for vdpbf16ps, which the C++ linears read (small_linear.cpp, and
    quant_linear.cpp's codes): blocks of 16 output channels, each block's input pairs in order, a pair's
    16 channels side by side with their two inputs adjacent; returned as [out, in] of that memory."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features // 16, 16, in_features // 2, 2).transpose(1, 2)
    packed = hugepages.empty((out_features, in_features), weight.dtype)
    packed.view(blocks.shape).copy_(blocks)
    return packed


def prepack_linears(model: nn.Module) -> int:
    """Replace every bf16 nn.Linear of `model` by a PrepackedLinear; returns how many. A tied LM head
    gets its own packed copy (the embedding keeps its weight for lookups)."""
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(False)}
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                gated = name == "gate_up_proj" and getattr(module, "act", None) is F.silu
                setattr(module, name, PrepackedLinear(child, tied=id(child.weight) in others, gated=gated))
                count += 1
    return count
