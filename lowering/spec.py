"""The epilogue spec: plain, hashable data that describes one fused chain.

The spec is what crosses from `lowering/` (which builds it from the graph) to
`cuda_templates/` (which renders a kernel from it) and `fusion_backend/` (which
runs it). It serializes to a JSON string, which is what the custom op carries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass

def to_float32(value: float) -> float:
    """value rounded to float32 (to nearest even), overflowing to infinity. Plain Python:
    specs are built and rendered under Dynamo's fake mode, where no tensor can be read."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # a finite double beyond float32's range
        return math.copysign(math.inf, value)


# Operand kinds of a binary step (`add`, `sub`, `mul`, `div`).
SCALAR = "scalar"  # a Python number baked into the kernel
CHANNEL = "channel"  # a tensor indexed by channel only (shape [C], [C, 1, 1], ...)
ONE = "one"  # a tensor with a single element
FULL = "full"  # a contiguous tensor with the chain's own shape (a residual)
SELF = "self"  # the chain's own value (`x + x`, `x * x`)
# An earlier value of the chain: consts = (k,), the value after k steps (0: the anchor
# output); also what a `branch` step goes on from.
EARLIER = "earlier"
# A norm's weight or bias of its segment's shape (LayerNorm over a conv output's trailing
# dims): element (position in the row) % segment length.
SEGMENT = "segment"
# A contiguous tensor that broadcasts over some of the chain's dims and has the chain's
# sizes in the others: [N, C, 1, 1] (a value per image and channel: a UNet's time
# embedding), [1, C, H, W] or [L, L] (the same for every image or batch: a position
# embedding, an attention bias), [N, 1, H, W] (per pixel), [M, 1] (per row), [B, 1, D]
# on a Linear's [B, T, D] (per sample: a DiT block's adaLN gate, over T rows), ... Its
# consts are `broadcast_terms`: element e of the chain's value (flat, in the graph's
# order) reads the operand's element sum((e // div % mod) * stride) over the
# (div, mod, stride) triples, mod 0 meaning no modulus (the leading dims, whose size is
# the batch's).
BROADCAST = "broadcast"


def broadcast_terms(consts: tuple) -> list[tuple[int, int, int]]:
    """The (div, mod, stride) triples of a BROADCAST operand's consts."""
    return [tuple(consts[i : i + 3]) for i in range(0, len(consts), 3)]


def broadcast_index(consts: tuple, e):
    """The operand's element for element(s) `e` of the chain's value (ints or a tensor)."""
    total = 0
    for div, mod, stride in broadcast_terms(consts):
        q = e // div
        total = total + (q % mod if mod else q) * stride
    return total


def broadcast_sizes(consts: tuple, per_row: int) -> tuple[int, int, int]:
    """(elements, elements a group of rows, rows a group) a BROADCAST operand holds, for
    rows of `per_row` elements of the chain's value (`operand_numel`): where a term has
    no modulus (the leading dims), a row's worth for every row (a group of one row), or
    where that term's divisor spans several rows (a [B, 1, D] operand of a Linear's
    [B, T, D]: T rows), a group's worth for every group of them; else a fixed count.

    Raises:
        ValueError: a leading term whose divisor neither divides a row nor is whole rows.
    """
    terms = broadcast_terms(consts)
    div, mod, stride = terms[0]
    if mod:  # only the first term can lead
        return 1 + sum((mod - 1) * stride for _, mod, stride in terms), 0, 1
    if per_row % div == 0:
        return 0, per_row // div * stride, 1
    if div % per_row == 0:
        return 0, stride, div // per_row
    raise ValueError(f"a broadcast operand's leading term divides by {div}, rows are {per_row} elements")


def operand_numel(sizes: tuple[int, int, int], rows: int) -> int | None:
    """The elements an operand of `sizes` (`EpilogueSpec.param_sizes`: elements, or
    elements a group of rows and rows a group) holds for `rows` rows of the anchor output;
    None where the rows are no whole number of groups (no operand fits)."""
    whole, per_group, group = sizes
    if whole:
        return whole
    return None if rows % group else per_group * (rows // group)


def operand_size_words(sizes: tuple[int, int, int], rows: int | None, dtype: str) -> str:
    """What an operand of `sizes` must hold for `rows` rows (None: not known), in words,
    for the launchers' and the rewrite's errors."""
    want = (sizes[0] or None) if rows is None else operand_numel(sizes, rows)
    if want is not None:
        return f"{want} {dtype} elements"
    per_group, group = sizes[1:]
    words = f"{per_group} {dtype} elements every {group} rows" if group > 1 else f"{per_group} {dtype} elements a row"
    return words if rows is None else f"{words}, and {rows} rows are no whole number of those"


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """A conv's output size along one dim (PyTorch's formula)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@dataclass(frozen=True)
class Anchor:
    """The matrix op that starts the chain.

    Attributes:
        kind: "addmm" (bias, mat1, mat2), "mm" (mat1, mat2), "bmm" (mat1[B, M, K],
            mat2[B, K, N]) or "conv" (input, weight[, bias]). A bmm's output [B, M, N]
            is read as a Conv1d's: rows B, channels M, one spatial dim of N (`conv_view`),
            so InstanceNorm, GroupNorm, BatchNorm1d, per-channel [M, 1] operands and
            LayerNorm over [N] mean what they mean there.
        has_bias: conv: whether a bias tensor is the third operand; bmm: a `baddbmm`,
            whose input is the third, added by the library call with `alpha` (cuBLAS
            rounds `input + alpha * (b1 @ b2)` once, as eager does; a chain that added
            the input to the rounded product would differ from eager by far more than a
            rounding where the two cancel).
        conv: conv only: (stride, padding, dilation, transposed, output_padding, groups).
        direct: conv only: (in_channels, kernel_h, kernel_w, in_h, in_w) when the conv
            is a candidate for the file's own conv kernels (2-D or 3-D, groups 1, static
            sizes; the direct conv takes 2-D convs of stride 1 and dilation 1, the
            in-kernel conv any dilation and strides up to 8); empty otherwise. The
            renderer still decides whether one covers it (else: the library conv runs
            first).
        depth: conv with `direct` only: (kernel_d, in_d) of a 3-D conv (`direct` then
            holds its height and width); empty for a 2-D one. `conv` keeps the 3-D
            parameters, depth first.
        gemm: addmm/mm only: (in_features, every_call) when the product is x[M, K] @ w[N, K]^T
            with x 2-D and w contiguous (a Linear's transposed weight), and a bias, if any,
            of shape [N]: a candidate for the in-kernel GEMM; empty otherwise. The renderer
            decides whether the in-kernel GEMM covers it (else: the library GEMM runs first).
            every_call: 1 to run it at every call (FUSEDEPI_IN_KERNEL_GEMM=1); 0 (auto) to
            run the library GEMM first at calls whose rows give too few tiles.
        pad: addmm/mm of that same x @ w^T form only: (k_to, n_to) when the library GEMM
            runs on operands padded with zeros to K = k_to and N = n_to (multiples of 8:
            cuBLAS's fast kernels need 16-byte aligned rows); the anchor output then has
            rows of n_to elements, of which the first N are the product. Empty: as the
            graph has it. The backend sets it (`fusion_backend.forms`).
        implicit: conv with `direct` only: the in-kernel conv (an implicit GEMM on sm_90,
            `cuda_templates.conv_gemm_plan`) may compute it where the direct conv does
            not. The matcher sets it under FUSEDEPI_IN_KERNEL_CONV=1, the backend where
            the measured choice finds it faster (`fusion_backend.forms`).
        channels_last: a library conv (2-D or 3-D) run on channels-last operands, where
            cuDNN has faster kernels for them: its output is then [rows, inner, channels]
            in memory, which the epilogue kernel reads and writes out in the graph's
            (contiguous) layout. The backend sets it (`fusion_backend.forms`).
        permuted: conv only: the chain follows a permute that moves the conv output's
            channels last (`y.permute(0, 2, 3, 1)`: ConvNeXt's LayerNorm, timm's
            LayerNorm2d). The conv runs on channels-last operands, and its output is
            read as a Linear's: rows = N x spatial, features = C (`conv_view` is
            False); the fused op returns [rows, C], viewed back to [N, *spatial, C].
        gemm_consumers: addmm/mm with `gemm` only: the in-kernel GEMM's consumer warps run
            a pointwise chain on every tile, and the producer's spare warps none (False:
            the spare warps run it at calls whose CTAs have several tiles,
            `cuda_templates.gemm_sm90`). The backend sets it (`fusion_backend.forms`).
        rounded: set with `implicit` on a float32 conv without a bias operand
            (`EpilogueSpec.with_in_kernel_conv`): the fused op's first two inputs are x
            and the weight rounded to the nearest TF32 value (ties away from zero, as
            cuDNN's TF32 convs round their operands; the tensor cores would truncate) by
            graph ops before it (`fusion_backend.ops.insert_chain`), and its last two are
            x and the weight themselves, which the library conv reads at calls where
            cuDNN's TF32 flag is off. The in-kernel conv takes float32 only so.
        flipped: conv only: a 2-D or 3-D ConvTranspose of stride 1 and groups 1 computed as the
            conv it equals, so that the direct and the in-kernel conv may take it: the
            graph's weight operand is the ConvTranspose's [C_in, C_out, kh, kw] (3-D:
            [C_in, C_out, kd, kh, kw]); `fusion_backend.ops.insert_chain` passes the fused
            op its transpose, flipped along every kernel dim ([C_out, C_in, kh, kw]),
            made by graph ops before the call; `conv` holds that conv's parameters
            (stride 1, padding dilation x (k - 1) - the ConvTranspose's, not transposed).
            The matcher sets it (`direct` too; a 3-D one's `depth`, which only the
            in-kernel conv takes).
        as_2d: conv only: a Conv1d computed as the 2-D conv of one row it equals, so that
            the direct and the in-kernel conv may take it: the graph's x [N, C, L] and
            weight [C_out, C / groups, k] reach the fused op as [N, C, 1, L] and
            [C_out, C / groups, 1, k] (views, graph ops before the call,
            `fusion_backend.ops.insert_chain`); `conv` holds the 2-D conv's parameters
            ((1, stride), (0, padding), (1, dilation), ...); its output [N, C_out, 1,
            L_out] is read as the Conv1d's [N, C_out, L_out]. The matcher sets it
            (`direct` too).
        library: conv only: the library conv computes a conv that the file's direct conv
            could (`direct` kept as its shapes), the epilogue kernel after it: taken where
            the chain measured faster so (`fusion_backend.forms.conv_library`).
            `with_in_kernel_conv` clears it.
        recompute: set with `implicit` on a chain with a norm the in-kernel conv's tiles
            take the statistics of (BatchNorm in training, a norm over whole channels):
            the conv runs twice, first for its tiles' moments alone, then again with the
            norm applied in the tile, so that the conv's value is never written (x read
            twice instead). The backend sets it where asked (FUSEDEPI_CONV_RECOMPUTE: off
            unless set; under "auto" where the chain measured faster so,
            `fusion_backend.forms.conv_recompute`).
    """

    kind: str
    has_bias: bool = False
    conv: tuple = ()
    direct: tuple = ()
    depth: tuple = ()
    gemm: tuple = ()
    pad: tuple = ()
    channels_last: bool = False
    implicit: bool = False
    permuted: bool = False
    gemm_consumers: bool = False
    rounded: bool = False
    flipped: bool = False
    as_2d: bool = False
    library: bool = False
    recompute: bool = False
    alpha: float = 1.0  # a baddbmm's (a bmm with `has_bias`): input + alpha * (b1 @ b2)

    def op_shapes(self, x_shape, w_shape) -> tuple[tuple, tuple]:
        """x's and the weight's shapes as the fused op takes them, given the graph's
        operands' (`flipped`: the ConvTranspose's weight [C_in, C_out, ...], transposed;
        `as_2d`: a Conv1d's, a row of height 1 inserted)."""
        x_shape, w_shape = tuple(x_shape), tuple(w_shape)
        if self.flipped:
            w_shape = (w_shape[1], w_shape[0], *w_shape[2:])
        if self.as_2d:
            x_shape, w_shape = (*x_shape[:2], 1, *x_shape[2:]), (*w_shape[:2], 1, *w_shape[2:])
        return x_shape, w_shape

    def as_1d(self) -> "Anchor":
        """An `as_2d` anchor as the graph's Conv1d (no kernel of the file's computes it)."""
        if not self.as_2d:
            return self
        stride, padding, dilation, transposed, out_pad, groups = self.conv
        conv = (stride[1:], padding[1:], dilation[1:], transposed, out_pad[1:], groups)
        return dataclasses.replace(self, conv=conv, direct=(), implicit=False, as_2d=False, recompute=False)

    def plane_conv(self) -> tuple[tuple, tuple, tuple]:
        """(stride, padding, dilation) over the height and width (a 3-D conv's last two)."""
        return tuple(tuple(p[-2:]) for p in self.conv[:3])

    def depth_conv(self) -> tuple[int, int, int]:
        """(stride, padding, dilation) over the depth of a 3-D candidate (`depth`); a
        2-D one's single plane: (1, 0, 1)."""
        return tuple(p[0] for p in self.conv[:3]) if self.depth else (1, 0, 1)

    def direct_out_hw(self) -> tuple[int, int]:
        """Output (H, W) of a candidate for the file's own conv kernels (`direct`)."""
        _, kh, kw, h, w = self.direct
        (sh, sw), (ph, pw), (dh, dw) = self.plane_conv()
        return conv_out_size(h, kh, sh, ph, dh), conv_out_size(w, kw, sw, pw, dw)

    def direct_out_d(self) -> int:
        """Output depth of a 3-D candidate (`depth`); 1 for a 2-D one."""
        if not self.depth:
            return 1
        kd, d = self.depth
        return conv_out_size(d, kd, *self.depth_conv())

    def direct_out_spatial(self) -> tuple[int, ...]:
        """The output's spatial dims as the graph has them, of a candidate for the file's own
        conv kernels: (H, W), a 3-D conv's (D, H, W) where `depth`, or a Conv1d's (L,)
        where `as_2d` (the kernels write the same bytes: its one row)."""
        ho, wo = self.direct_out_hw()
        if self.depth:
            return (self.direct_out_d(), ho, wo)
        return (wo,) if self.as_2d else (ho, wo)

    @property
    def unit_stride(self) -> bool:
        """A conv of stride 1 and dilation 1 in every dim."""
        stride, _, dilation = self.conv[:3]
        return all(s == 1 for s in stride) and all(d == 1 for d in dilation)

    @property
    def is_baddbmm(self) -> bool:
        """A bmm with `has_bias`: input + alpha * (b1 @ b2), its operands (b1, b2, input)."""
        return self.kind == "bmm" and self.has_bias

    @property
    def n_operands(self) -> int:
        if self.kind == "addmm":
            return 3
        if self.kind == "mm":
            return 2
        return 3 if self.has_bias else 2  # conv: with its bias; bmm: a baddbmm, with its input

    @property
    def conv_view(self) -> bool:
        """Whether the output is [rows, channels, *spatial] (a conv's, a bmm's), not a
        Linear's [rows, features]: a permuted conv's is read as the latter)."""
        return self.kind in ("conv", "bmm") and not self.permuted

    @property
    def spatial_dims(self) -> int:
        """How many spatial dims the output has after its channels (`conv_view` only), as
        the graph has it (an `as_2d` Conv1d's one)."""
        return 1 if self.kind == "bmm" or self.as_2d else len(self.conv[0])


@dataclass(frozen=True)
class Step:
    """One epilogue step, named from the vocabulary (`lowering/vocabulary.py`).

    Attributes:
        name: vocabulary entry, e.g. "gelu", "groupnorm", "mul".
        consts: compile-time numbers (slope, eps, momentum, a scalar operand).
        inputs: indices into the fused op's tensor list (after the anchor operands).
            For norms: (weight, bias[, running_mean, running_var]), -1 where absent.
        operand: for binary steps, one of SCALAR, CHANNEL, ONE, FULL, SELF, EARLIER,
            BROADCAST; for `branch`, EARLIER (the value the chain goes on from).
        reverse: for binary steps, the chain's value is the right operand (`p - x`).
        groups: for groupnorm, the number of groups.
        keepdim: for row, spatial and channel reductions.
        window: for a pooling window (`POOLS`) over a conv output's spatial dims, one
            tuple per dim each: (in_sizes, out_sizes, kernel, stride, padding, dilation);
            its consts are (ceil_mode,) for maxpool, (ceil_mode, count_include_pad,
            divisor_override or 0) for avgpool (PyTorch's meanings). Over a Linear
            output's features: a 1-D window, keepdim when the pooled [rows, 1, N'] value
            is not squeezed back to [rows, N'].
        normalized: for a layernorm over a conv output's trailing dims, their sizes
            (normalized_shape); `groups` is then the segments a row. Empty: over the
            features of a linear output.
    """

    name: str
    consts: tuple = ()
    inputs: tuple = ()
    operand: str = ""
    reverse: bool = False
    groups: int = 0
    keepdim: bool = False
    window: tuple = ()
    normalized: tuple = ()


@dataclass(frozen=True)
class Save:
    """A value the fused op also returns because the graph uses it elsewhere (in a
    training graph: saved for backward): the chain's value after `at` steps, or the
    statistics of the chain's normalization.

    Attributes:
        what: "value"; "mean" / "rstd" of the normalization (GroupNorm and LayerNorm
            per segment, BatchNorm per channel, whose "rstd" is 1/sqrt(var + eps);
            RMSNorm's "rstd" is rsqrt(mean(x^2) + eps) per row);
            or "sigmoid": the sigmoid of a silu step's input (`x * sigmoid(x)`).
        at: for "value", how many steps had been applied (0: the anchor output
            itself); for "sigmoid", the index of the silu step.
        dtype: the output's dtype.
        shape: the output's shape with its batch-sized dim as -1 (as is when `per_row` is
            0): the first dim, or the one symbolic dim of a graph with a dynamic batch
            where that is another (InstanceNorm's statistics, [1, N * C, 1, 1]).
        per_row: output elements per row of the anchor output (0: a fixed shape,
            BatchNorm's per-channel statistics).
    """

    what: str
    dtype: str
    shape: tuple
    per_row: int
    at: int = 0

    def sized(self, rows):
        """The output's shape for `rows` anchor rows: its dim marked -1 holds the
        `rows * per_row` elements that the others leave."""
        if not self.per_row:
            return tuple(self.shape)
        at = self.shape.index(-1) if -1 in self.shape else 0
        rest = 1
        for i, s in enumerate(self.shape):
            rest *= s if i != at else 1
        return tuple(rows * self.per_row // max(rest, 1) if i == at else s for i, s in enumerate(self.shape))


@dataclass(frozen=True)
class EpilogueSpec:
    """A whole fused chain: anchor, steps and the layout they run on.

    The anchor output is viewed as [rows, channels, inner]: for a linear layer
    rows = M, channels = N, inner = 1; for a conv rows = batch, channels = C,
    inner = H*W; for a bmm rows = B, channels = M, inner = N. `rows` is the only size
    left to run time.

    Attributes:
        anchor: the matrix op.
        steps: the epilogue, in order.
        dtype: "float32", "float16" or "bfloat16" (the anchor output's dtype).
        param_dtypes: dtype of each tensor input after the anchor operands.
        channels: C.
        inner: spatial elements per channel (1 for linear).
        fusion: the fusion's name (anchor family + kind of reduction), used by
            `FUSEDEPI_DISABLE` and `explain`.
        saves: values the fused op returns after its result and BatchNorm's new
            running statistics, in order.
    """

    anchor: Anchor
    steps: tuple
    dtype: str
    param_dtypes: tuple
    channels: int
    inner: int
    fusion: str = ""
    saves: tuple = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "EpilogueSpec":
        data = json.loads(text)
        anchor = data.pop("anchor")
        anchor["conv"] = _tuples(anchor["conv"])
        anchor["direct"] = _tuples(anchor.get("direct", ()))
        anchor["depth"] = _tuples(anchor.get("depth", ()))
        anchor["gemm"] = _tuples(anchor.get("gemm", ()))
        anchor["pad"] = _tuples(anchor.get("pad", ()))
        steps = tuple(
            Step(**{**s, "consts": tuple(s["consts"]), "inputs": tuple(s["inputs"]),
                    "window": _tuples(s.get("window", ())), "normalized": tuple(s.get("normalized", ()))})
            for s in data.pop("steps")
        )
        saves = tuple(Save(**{**s, "shape": tuple(s["shape"])}) for s in data.pop("saves", ()))
        return EpilogueSpec(
            anchor=Anchor(**anchor),
            steps=steps,
            saves=saves,
            param_dtypes=tuple(data.pop("param_dtypes")),
            **data,
        )

    def with_in_kernel_conv(self) -> "EpilogueSpec":
        """This spec with the in-kernel conv as its conv's form (`Anchor.implicit`; not the
        library's, `Anchor.library`), on operands rounded to TF32 in float32 without a bias
        operand (`Anchor.rounded`)."""
        rounded = self.dtype == "float32" and not self.anchor.has_bias
        anchor = dataclasses.replace(self.anchor, implicit=True, channels_last=False, rounded=rounded, library=False)
        return dataclasses.replace(self, anchor=anchor)

    def with_norm_recomputed(self) -> "EpilogueSpec":
        """This in-kernel conv spec with its norm recomputed (`Anchor.recompute`)."""
        return dataclasses.replace(self, anchor=dataclasses.replace(self.anchor, recompute=True))

    def with_first_step(self, step: Step, param_dtype: str) -> "EpilogueSpec":
        """This spec with `step` run before its steps (and `param_dtype` appended to its
        tensor inputs), for an anchor whose output no longer includes what `step` adds:
        the value this spec had after k steps is then the value after k + 1, so every
        position that names one moves (an EARLIER operand's k, a save's `at`)."""
        steps = (step,) + tuple(dataclasses.replace(s, consts=(s.consts[0] + 1,) + tuple(s.consts[1:]))
                                if s.operand == EARLIER else s for s in self.steps)
        saves = tuple(dataclasses.replace(v, at=v.at + 1) if v.what in ("value", "sigmoid") else v
                      for v in self.saves)
        return dataclasses.replace(self, steps=steps, saves=saves, param_dtypes=tuple(self.param_dtypes) + (param_dtype,))

    @property
    def reduction(self) -> Step | None:
        """The first step that needs statistics over more than one element, if any."""
        for step in self.steps:
            if step.name in REDUCTIONS:
                return step
        return None

    @property
    def second_reduction(self) -> Step | None:
        """A reduction after the chain's norm (`REDUCTIONS_AFTER_A_NORM`), if any: it
        shrinks the normalized value, which is then never written."""
        found = [step for step in self.steps if step.name in REDUCTIONS]
        return found[1] if len(found) > 1 else None

    @property
    def output_reduction(self) -> Step | None:
        """The reduction that shapes the output: the second, else the first."""
        return self.second_reduction or self.reduction

    @property
    def y_row(self) -> int:
        """Elements between two rows of the anchor output as the kernels read it: the
        padded N of a padded library GEMM, else channels * inner."""
        return self.anchor.pad[1] if self.anchor.pad else self.channels * self.inner

    def param_sizes(self) -> tuple:
        """(elements, elements a group of rows, rows a group) of each tensor input after
        the anchor operands, as the kernels read it (`operand_numel`): a per-channel
        operand or a norm's weight, bias and running statistics hold `channels` elements,
        a single-element operand one, a full operand (a residual) a row's worth for every
        row of the anchor output, a broadcast one what `broadcast_sizes` says: the
        launchers check every call's inputs against these before any kernel reads them."""
        known = self.__dict__.get("_param_sizes")  # computed once a spec (launchers ask at every call)
        if known is not None:
            return known
        sizes = [(0, 0, 1)] * len(self.param_dtypes)
        per_row = self.channels * self.inner  # elements a row of the chain's value has
        for step in self.steps:
            if step.operand:
                if step.operand in (CHANNEL, ONE, FULL):
                    sizes[step.inputs[0]] = {CHANNEL: (self.channels, 0, 1), ONE: (1, 0, 1),
                                             FULL: (0, per_row, 1)}[step.operand]
                elif step.operand == BROADCAST:
                    sizes[step.inputs[0]] = broadcast_sizes(step.consts, per_row)
            else:
                per = math.prod(step.normalized) if step.normalized else self.channels
                for index in step.inputs:
                    if index >= 0:
                        sizes[index] = (per, 0, 1)
            if step.name in ROW_REDUCTIONS:
                per_row = 1
            elif step.name in SPATIAL_REDUCTIONS:
                per_row = self.channels
            elif step.name in CHANNEL_REDUCTIONS:
                per_row = self.inner
            elif step.name in POOLS:  # a conv's channels pooled, or a Linear row's features
                per_row = (self.channels if self.anchor.conv_view else 1) * math.prod(step.window[1])
        object.__setattr__(self, "_param_sizes", tuple(sizes))  # not a field: equality and JSON ignore it
        return self._param_sizes

    @property
    def row_output(self) -> bool:
        """True when a reduction shrinks the output: to one value per row (a row
        reduction), per (row, channel) (a spatial reduction), per (row, pixel) (a
        reduction over a conv's channels), or per (row, channel, window) (a pool)."""
        red = self.output_reduction
        return red is not None and red.name in ROW_REDUCTIONS + SPATIAL_REDUCTIONS + CHANNEL_REDUCTIONS + POOLS

    def reduced_tail(self) -> tuple:
        """The reduced output's dims after the rows (`row_output` only), up to the conv's
        spatial dims, which a reduction over its channels keeps (`keeps_spatial`): a row
        reduction's () or (1,) with keepdim; a spatial reduction's (C,), or (C, 1, ...)
        with one 1 per spatial dim; a channel reduction's (), or (1,) with keepdim; a
        pool's (C, *pooled spatial sizes), or over a Linear output's features (N',), or
        (1, N') with keepdim (the unit dim the 1-D pool's input had)."""
        red = self.output_reduction
        if red.name in ROW_REDUCTIONS + CHANNEL_REDUCTIONS:
            return (1,) if red.keepdim else ()
        if red.name in POOLS:
            if not self.anchor.conv_view:
                return ((1,) if red.keepdim else ()) + tuple(red.window[1])
            return (self.channels,) + tuple(red.window[1])
        return (self.channels,) + ((1,) * self.anchor.spatial_dims if red.keepdim else ())

    @property
    def keeps_spatial(self) -> bool:
        """A reduction over a conv's channels: its reduced output ends in the conv's
        spatial dims, after `reduced_tail`."""
        red = self.output_reduction
        return red is not None and red.name in CHANNEL_REDUCTIONS

    def kernel_name(self, arch: str) -> str:
        """A readable name built from the spec, e.g. addmm_groupnorm_silu_mul_f32_sm90."""
        parts = [self.anchor.kind] + [s.name for s in self.steps]
        if self.saves:
            parts.append(f"saves{len(self.saves)}")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[self.dtype]
        return "_".join(parts + [short, arch])


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


# Steps whose statistics span several elements.
# Row reductions shrink the output to one value per row (of a 2-D linear output).
ROW_REDUCTIONS = ("logsumexp", "sum", "mean", "amax", "amin")
# Spatial reductions shrink a conv output [rows, C, *spatial] to one value per (row,
# channel) (global pooling: `mean(dim=[2, 3])`, `adaptive_avg_pool2d(x, 1)`); each is
# its row reduction's operation over a channel's `inner` elements.
SPATIAL_REDUCTIONS = ("spatial_sum", "spatial_mean", "spatial_amax", "spatial_amin")
# Reductions over a conv output's channels, per pixel: one value per (row, pixel), or
# (the norms) the output's shape, normalized over each pixel's channels.
CHANNEL_REDUCTIONS = ("channel_logsumexp", "channel_sum", "channel_mean", "channel_amax", "channel_amin")
CHANNEL_NORMS = ("channel_softmax", "channel_log_softmax")
# Pooling windows over a conv output's spatial dims (MaxPool / AvgPool 1d, 2d, 3d):
# [rows, C, *spatial] -> [rows, C, *pooled]; or a 1-D window over a Linear output's
# features ([rows, N] -> unsqueeze(1) -> pool -> [rows, N']); `Step.window` holds the geometry.
POOLS = ("maxpool", "avgpool")
# Normalized by (mean, rstd) per segment: a group of channels, or the whole row;
# segments longer than a block are split over several blocks.
SEGMENT_NORMS = ("groupnorm", "layernorm")
# Normalized by two statistics of the whole row, which one team of threads holds
# (l2normalize: F.normalize's y / max(||y||, eps) over the features).
ROW_NORMS = ("rmsnorm", "softmax", "log_softmax", "l2normalize")
# Softmax over each (row, channel) plane of a conv or bmm output: `softmax(dim=-1)` of a
# Conv1d's or bmm's [B, M, N] (attention scores), or of a view that flattened a conv's
# spatial dims ([N, C, H*W]) or regrouped the rows ([B*H, L, L] -> [B, H, L, L]); a team
# of threads a plane.
SPATIAL_NORMS = ("spatial_softmax", "spatial_log_softmax")
REDUCTIONS = (SEGMENT_NORMS + ROW_NORMS + SPATIAL_NORMS + ROW_REDUCTIONS + SPATIAL_REDUCTIONS + CHANNEL_REDUCTIONS
              + CHANNEL_NORMS + POOLS + ("batchnorm_train",))
# A second reduction may follow one of these norms (with pointwise steps between and
# after): a spatial reduction of a conv's GroupNorm / InstanceNorm / BatchNorm (training)
# or of a LayerNorm over whole channels (global pooling after the norm), or a row
# reduction of a Linear's LayerNorm or BatchNorm1d. Each norm segment (a group, a
# channel, a row) is reduced per channel inside the kernel that normalizes it, so the
# normalized value is never written.
NORMS_BEFORE_A_REDUCTION = SEGMENT_NORMS + ("batchnorm_train",)
REDUCTIONS_AFTER_A_NORM = ("sum", "mean", "amax", "amin") + SPATIAL_REDUCTIONS
# Channels of one norm segment the second reduction takes apart (a GroupNorm's channels
# per group): the kernel reduces each with its own pass over the team's values.
SECOND_REDUCTION_MAX_CHANNELS = 16
# A fusion is named after its anchor family and the first of these steps it holds,
# or "pointwise": linear_groupnorm, conv_batchnorm_eval, linear_pointwise, ...
NAMED_STEPS = REDUCTIONS + ("batchnorm_eval",)
# Anchor forms FUSEDEPI_DISABLE can switch off: "direct_conv" keeps convolutions on
# the library (cuDNN) with only the epilogue fused. (The in-kernel GEMM has its own setting:
# FUSEDEPI_IN_KERNEL_GEMM.)
ANCHOR_FORMS = ("direct_conv",)
FUSION_NAMES = tuple(f"{family}_{kind}" for family in ("linear", "bmm", "conv")
                     for kind in NAMED_STEPS + ("pointwise",))
