"""Reduced-precision weight paths: bfloat16, and 8- and 4-bit weight-only quantisation.

A decode step reads every weight once, so its time is bounded by the bytes of the weights.
The exact path keeps float32; three reduced paths trade exactness for bytes:

- `bfloat16`: weights, activations and the KV state in bfloat16 (half the bytes).
- `int8`: each affine map x ↦ x Wᵀ + b keeps W ≈ diag(s) Q with Q ∈ {−127, …, 127}^{r×c}
  and one scale per output channel, s_r = max_c |W_rc| / 127 (a quarter of the bytes); the
  products read x in bfloat16 (PyTorch's `_weight_int8pack_mm`).
- `int4`: 4-bit weights with a float16 scale and offset per group of 32 inputs, GGUF's Q4_1
  grid (5 bits a weight), so a Q4_1 file's tensors come back without new loss. Their
  product is hybridlm's own kernel (`hybridlm.lm.kernels`: the input in 16 bits per group of
  32, integer multiply-adds), where it can be built, else PyTorch's int4 kernel.

In the quantised paths the residual stream, norms, attention and KV state stay float32. The
unembedding W_u is quantised as the layers are (int8 or int4) and its leading logits are
recomputed from the exact rows, which the embedding lookup keeps anyway.

`agreement` measures what the trade costs: teacher-forced greedy next-token agreement
with the exact path over a text.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.lm import kernels
from hybridlm.errors import InputError
from hybridlm.memory import return_freed_memory
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.linear import Linear

PRECISIONS = ("float32", "bfloat16", "int8", "int4")

_MATMUL_DTYPE = torch.bfloat16  # what PyTorch's quantised kernels read x as (their fast path)


class Int8Linear(DirectModule):
    """x ↦ (x Qᵀ) ⊙ s + b, Q int8 [out, in] with one scale per output channel s [out]."""

    Q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float().contiguous()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("Q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(_MATMUL_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_features, self.in_features = weight.shape

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised W = diag(s) Q (for analysis; the forward never forms it)."""
        return self.Q.float() * self.scale.float()[:, None]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
            return torch._weight_int8pack_mm(x, self.Q, self.scale)
        return (x @ self.Q.to(x.dtype).T) * self.scale  # no fused kernel here: dequantise on the fly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _affine(self, x)


class Int4Linear(DirectModule):
    """x ↦ x Ŵᵀ + b with Ŵ = d_g q + m_g, q ∈ {0..15}, one (d, m) per group g of 32 inputs.

    The groups are quantised from their min and max (m_g = min, d_g = (max − min)/15) with d
    and m in float16, as GGUF's Q4_1 does, so a tensor that came from a Q4_1 file is
    represented again without new loss. Stored: `packed` [out, in/2] uint8 (q of input i of
    a group in the low nibble, of input i + 16 in the high one), and the bits of d and m
    [out, in/32] as int16 (`d_bits`, `m_bits`: integers, so `.to(dtype)`, `.double()` or
    `.half()` on the model leave them alone); `d` and `m` read them as float16.

    The product, by where it runs:
    - float32 on the CPU: hybridlm's kernel (`hybridlm.lm.kernels`), which takes x in 16 bits
      per group of 32 (a scale per group) and the offsets against the exact group sums of x;
    - where that kernel cannot be built: PyTorch's int4 kernel, on its own copy of the
      weights (`aten_packed`, for a multiple of 16 outputs) and x in bfloat16;
    - elsewhere (another device, another dtype, or autograd through x): x Ŵᵀ with Ŵ
      dequantised on the fly.
    """

    group = 32
    rows_at_once = 4096
    packed: torch.Tensor
    d_bits: torch.Tensor
    m_bits: torch.Tensor
    bias: torch.Tensor | None
    aten_packed: torch.Tensor | None
    scales_and_zeros: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out, inp = weight.shape
        if inp % self.group:
            raise InputError(f"int4 needs input widths divisible by {self.group}, got {inp}")
        groups = inp // self.group
        d = torch.empty(out, groups, dtype=torch.float16)
        m = torch.empty(out, groups, dtype=torch.float16)
        q = torch.empty(out, groups, self.group, dtype=torch.uint8)
        for r0 in range(0, out, self.rows_at_once):  # in blocks of rows: a readout's temporaries stay small
            r1 = min(r0 + self.rows_at_once, out)
            w = weight[r0:r1].detach().float().contiguous().view(r1 - r0, groups, self.group)
            lo, hi = w.amin(-1), w.amax(-1)
            d[r0:r1] = ((hi - lo) / 15).clamp_min(2.0**-24).half()  # float16's least step: a flat group keeps d > 0
            m[r0:r1] = lo.half()
            if not (torch.isfinite(d[r0:r1]).all() and torch.isfinite(m[r0:r1]).all()):
                raise InputError(f"int4: weights up to {float(w.abs().max()):.3g} exceed float16's range of scales "
                                 f"and offsets (±65504)")
            q[r0:r1] = torch.round((w - m[r0:r1].float()[..., None]) / d[r0:r1].float()[..., None]).clamp(0, 15)
        self.register_buffer("packed", (q[..., :16] | (q[..., 16:] << 4)).view(out, inp // 2).contiguous())
        self.register_buffer("d_bits", d.contiguous().view(torch.int16))
        self.register_buffer("m_bits", m.contiguous().view(torch.int16))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_features, self.in_features = out, inp
        self.register_buffer("aten_packed", None)
        self.register_buffer("scales_and_zeros", None)
        if weight.device.type != "cpu" or kernels.int4() is not None:
            return
        kernels.warn_unavailable()
        if _aten_int4_kernel() and out % 16 == 0:
            # PyTorch's layout: Ŵ = (q − 8)·d + z with z = m + 8d, scales and zeros [groups, out, 2]
            self.aten_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out, inp).int(), 8)
            self.scales_and_zeros = torch.stack([d.float(), m.float() + 8 * d.float()], -1).transpose(0, 1) \
                .contiguous().to(_MATMUL_DTYPE)

    @property
    def d(self) -> torch.Tensor:
        """The scales d [out, in/32] (float16)."""
        return self.d_bits.view(torch.float16)

    @property
    def m(self) -> torch.Tensor:
        """The offsets m [out, in/32] (float16)."""
        return self.m_bits.view(torch.float16)

    def q(self) -> torch.Tensor:
        """The 4-bit codes q [out, in/32, 32]."""
        p = self.packed.view(self.out_features, -1, 16)
        return torch.cat([p & 0x0F, p >> 4], dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        """Ŵ = d q + m in float32 (for analysis, and the product off the CPU)."""
        w = self.d.float()[..., None] * self.q().float() + self.m.float()[..., None]
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.int4()
        if kernel is not None and x.dtype == torch.float32 and x.is_cpu and self.packed.is_cpu and not (
                x.requires_grad and torch.is_grad_enabled()):
            return kernel.affine(x, self.packed, self.d_bits, self.m_bits, self.bias)
        if self.aten_packed is not None and x.is_cpu and not x.requires_grad:
            return _affine(self, x)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), b)

    def kernel_tensors(self) -> tuple | None:
        """What the compiled blocks read of this map (`hybridlm.lm.step`); None for a subclass."""
        return (self.packed, self.d_bits, self.m_bits, self.bias) if type(self) is Int4Linear else None

    def kernel_product(self) -> kernels.Product | None:
        """This map as the compiled blocks read it (the addresses of its codes, scales, offsets and
        bias), or None where they are not contiguous on the CPU."""
        codes = (self.packed, self.d_bits, self.m_bits)
        if not all(t.is_cpu and t.is_contiguous() for t in codes) or not kernels.plain_vector(self.bias,
                                                                                            self.out_features):
            return None
        return kernels.Product(packed=codes[0].data_ptr(), d=codes[1].data_ptr(), m=codes[2].data_ptr(),
                               bias=kernels.address(self.bias), K=self.in_features, N=self.out_features)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x Ŵᵀ by PyTorch's int4 kernel (x in bfloat16), for `_affine`."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.aten_packed, self.group, self.scales_and_zeros)


class RefinedReadout(DirectModule):
    """z = LN_f(h) W_uᵀ from a quantised W_u (int8 or int4), then made exact on the k most
    likely tokens.

    The quantised product ranks the vocabulary; the k leading rows are recomputed from the
    exact float32 W_u (which the embedding lookup keeps anyway), so the argmax, and most
    of the mass a sampler sees, come from exact logits at the cost of k rows.
    """

    def __init__(self, unembedding: torch.Tensor, k: int = 32, kind=None) -> None:
        super().__init__()
        self.approx = (kind or Int8Linear)(unembedding, None)
        self.exact = unembedding  # a reference to the model's own parameter, not a copy
        self.k = k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.approx(h)
        top = z.topk(self.k, dim=-1).indices  # [..., k]
        exact = (self.exact[top] @ h.unsqueeze(-1)).squeeze(-1)  # rows of W_u against h
        return z.scatter(-1, top, exact)


def _affine(layer, x: torch.Tensor) -> torch.Tensor:
    """A PyTorch quantised product in bfloat16, everything around it (residual stream, norms,
    attention, the state) in the model's own dtype."""
    shape = x.shape
    y = layer.product(x.reshape(-1, shape[-1]).to(_MATMUL_DTYPE)).to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.dtype)
    return y.view(*shape[:-1], layer.out_features)


def _aten_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def set_precision(model, precision: str):
    """Convert a loaded float32 model in place to one of PRECISIONS; returns the model.

    bfloat16: every weight and activation in bfloat16. int8 / int4: the weights of every
    affine map quantised (the products' inputs as `Int8Linear` and `Int4Linear` say), and
    everything else (residual stream, norms, attention, the KV state) left in float32; the
    unembedding is quantised the same way, with its k leading logits recomputed exactly
    (`RefinedReadout`).
    """
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bfloat16":
        model.to(torch.bfloat16)
    elif precision in ("int8", "int4"):
        kind = Int8Linear if precision == "int8" else Int4Linear
        _quantize_linears(model, kind)
        _rows_contiguous(model)
        model.readout_map = RefinedReadout(model.unembedding, kind=kind)
    model.precision = precision
    return model


def quantized_model(cfg, weights, precision: str):
    """A DecoderLM of `cfg` on int8 or int4 weights built from `weights` (a state dict, or a
    Mapping that reads each tensor when asked) without a float32 copy of the model: the
    skeleton is made on the "meta" device, each affine map is quantised from its float32
    weight as it is read, and only what stays float32 (W_e, norms, biases) is materialised.
    The same model as `set_precision(float32 model, precision)`, bit for bit."""
    from hybridlm.lm.model import DecoderLM
    from hybridlm.lm.positions import Rotary

    kind = Int8Linear if precision == "int8" else Int4Linear
    with torch.device("meta"):
        model = DecoderLM(cfg)
    _quantize_linears(model, kind, weights)
    for full, param in list(model.named_parameters()):
        if param.is_meta:
            owner_name, _, name = full.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, name, nn.Parameter(weights[full].contiguous(), requires_grad=False))
    if model.rotary is not None:
        model.rotary = Rotary(cfg)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t is not None and t.is_meta]
    if left:
        raise InputError(f"quantised build: {left[:3]} were not materialised")
    model.readout_map = RefinedReadout(model.unembedding, kind=kind)
    model.precision = precision
    return_freed_memory()
    return model


def _rows_contiguous(model) -> None:
    """W_e (and an untied W_u) row by row: once no exact product streams them, only row
    lookups read them (the embedding, and the k rows `RefinedReadout` recomputes), and a row
    of a column-major matrix is a strided gather (~0.1 ms each lookup here)."""
    with torch.no_grad():
        for name in ("W_e", "W_u"):
            p = getattr(model, name)
            if p is not None and not p.is_contiguous():
                setattr(model, name, nn.Parameter(p.contiguous(), requires_grad=p.requires_grad))


def _quantize_linears(module: nn.Module, kind, weights=None, prefix: str = "") -> None:
    """Every `Linear` below `module` replaced by `kind`, from its own weight and bias or, given
    `weights` (a state dict of the model, read when asked), from theirs by name."""
    for name, child in list(module.named_children()):
        if not isinstance(child, Linear):
            _quantize_linears(child, kind, weights, f"{prefix}{name}.")
        elif weights is None:
            setattr(module, name, kind(child.weight, child.bias))
        else:
            bias = weights[f"{prefix}{name}.bias"] if child.bias is not None else None
            setattr(module, name, kind(weights[f"{prefix}{name}.weight"], bias))
            return_freed_memory()  # each matrix's float32 copy and temporaries, gone


@torch.no_grad()
def agreement(model, reference, ids) -> dict:
    """Teacher-forced greedy agreement: at each position of `ids`, does argmax z match?

    Both models read the same text in one prefill; returns the fraction of positions whose
    next-token argmax agrees, and the largest |Δ logit| (in float32).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    z = model(ids)[0].float()
    z_ref = reference(ids)[0].float()
    same = (z.argmax(-1) == z_ref.argmax(-1)).float()
    return {"positions": int(same.numel()), "agreement": float(same.mean()),
            "max_abs_logit_diff": float((z - z_ref).abs().max())}
