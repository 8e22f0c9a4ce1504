"""Sparse mixture-of-experts feed-forward (Hugging Face `Qwen3MoeSparseMoeBlock`, and with a gated
shared expert `Qwen3NextSparseMoeBlock`) and the router load-balancing loss on tree batches.

Parameters keep HF's names and layouts: `gate.weight` [E, hidden], `experts.gate_up_proj`
[E, 2 * moe_intermediate, hidden] (gate rows first), `experts.down_proj` [E, hidden,
moe_intermediate]; Nemotron 3's squared-ReLU experts have no gate (`experts.up_proj`
[E, moe_intermediate, hidden]). gpt-oss's block is the same module with a router bias, expert
biases and the clamped SwiGLU; its HF tensors (`mlp.router`, gate/up interleaved, per-expert
transposes) are mapped by its record (`jtree.models.architectures.gpt_oss`). Experts run
dropless: the (token, expert) assignments are sorted by expert and multiplied with
`jax.lax.ragged_dot` (on GPUs, whose XLA expands it densely, with the tile loop of
`jtree.kernels.grouped_matmul`), so no token is ever dropped and the math equals HF's loop. Routing replay
(docs/rl.md) hands the block the rollout engine's experts per token: the router then weighs
those instead of its own top-k (`TopKRouter`), on every dispatch path below.

Load-balancing loss on a tree. HF (`load_balancing_loss_func` with the attention mask) pools all
MoE layers and all non-padding tokens of the forward batch:
    f_e = sum_{l,t} [e in top_k(l, t)] / (L T),   P_e = sum_{l,t} softmax(l, t)_e / (L T),
    aux = E * sum_e f_e P_e
On the per-path baseline a shared tree token occurs once per path through it, so the tree computes
the same sums with each token weighted by `path_count` (its multiplicity in the baseline batch) and
T = sum of path_count: f_e and P_e, hence aux and its gradient, equal the baseline's exactly. It is
a ratio of batch sums, so like HF it is defined per forward pass (one micro-batch). Under data
parallelism (`data_axis`) the sums are pooled over the data shards of the micro-batch, so the loss
is the single-device one, and each shard returns 1/shards of it (the step sums the shards). A
batch can instead be given the routing counts of a larger forward it is a piece of (the batch's
`router_load`: counts and total; the parts of a tree split redundancy-free), which makes the
pieces' losses add up to that forward's.

Tensor parallelism (`tp_axis`, inside `shard_map`): expert parallel. Each device holds
num_experts / tp whole experts (the expert axis of both expert tensors is split, HF layout kept)
and the replicated router; the tokens are already on every device of the tensor-parallel group
(the attention output is all-reduced), so by default (`expert_dispatch="psum"`) there is no
all-to-all: every device routes all tokens identically, runs only the (token, expert)
assignments of its own experts (dropless, its assignments sorted first, the rest outside every
`ragged_dot` group and masked) and the partial outputs are summed with one `psum`. Qwen3-Next's
shared expert is a Megatron SwiGLU whose partial output joins the same sum. Cost per MoE layer:
one all-reduce of [tokens, hidden] forward and one backward (the same as a Megatron MLP), plus a
tiny all-reduce of the router's gradient; expert compute per device is 1/tp of the total when
routing is balanced.

Token dispatch (`expert_dispatch="all_to_all"`, `RuntimeConfig.expert_dispatch`): the same expert
split, but each device of the group takes 1/tp of the tokens (padded to a multiple of tp), routes
them, and sends every (token, expert) assignment to the device owning the expert with one
`all_to_all`; that device runs its experts on what it received (sorted by expert, `ragged_dot`),
a second `all_to_all` returns the results, the sender combines them with its router weights, and
an all-gather gives every device the whole output again. The shared expert stays Megatron-split:
its partial outputs are reduce-scattered onto the same token split before that all-gather (one
reduce-scatter plus one all-gather: the cost of the psum it replaces). The router statistics are
all-gathered, so the load-balancing loss sees every token as before.

The exchange is dropless with a static capacity, since XLA:CPU has no `ragged_all_to_all` (jax
0.10): each device reserves, for every destination, room for all of its assignments that could go
there (its tokens x min(top_k, experts per device)), so no routing, however uneven, drops a token,
and the buffers are as large as the worst case. Cost per MoE layer: each all-to-all moves tokens x
min(top_k, experts per device) x hidden per device, about min(top_k, experts per device) / 2 times
the psum's all-reduce; the experts' `ragged_dot` has at most the psum path's rows (tokens x
min(top_k, experts per device) against tokens x top_k); the router runs on 1/tp of the tokens.
Dispatch gets cheaper than the psum only with an exchange that moves just the assignments
actually routed (`ragged_all_to_all` on GPU/TPU), which the CPU backend can neither run nor test.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.kernels.grouped_matmul import TILE, pick_grouped_matmul, tile_layout, tiled_matmul
from jtree.kernels.precision import accumulation_dtype
from jtree.models.layers import ReluSquaredMLP, SwiGLU, linear


class RouterStats(NamedTuple):
    """What the load-balancing loss needs from one MoE layer, per token: [N, E] and [N, k]."""

    probs: jax.Array
    top_experts: jax.Array


class TopKRouter(nnx.Module):
    """softmax (fp32) over expert logits, top-k, optional renormalization (HF `*TopKRouter`);
    `bias` adds gpt-oss's router bias to the logits. gpt-oss's softmax over the top-k logits is
    the renormalized top-k of the full softmax (`norm_topk_prob`)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, *,
                 init_std: float, param_dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False):
        init = nnx.initializers.normal(init_std)
        self.weight = nnx.Param(init(rngs.params(), (num_experts, hidden), param_dtype))
        # gpt-oss's router bias (HF inits it like the weight)
        self.bias = nnx.data(nnx.Param(init(rngs.params(), (num_experts,), param_dtype))
                             if bias else None)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def __call__(self, x: jax.Array, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, RouterStats]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, experts [N, k], stats).

        `replay` [N, k] int32 (routing replay, docs/rl.md): the experts the rollout engine chose
        for each token, -1 where the token keeps its own top-k. A replayed token's weights are
        this router's probabilities of the replayed experts, renormalized by the same
        `norm_topk_prob` rule, so the router's gradient flows through them as it does through
        its own choice. The statistics (the load-balancing loss) keep the router's own top-k, as
        HF's loss recomputes top-k from the router logits."""
        logits = x @ self.weight[...].astype(x.dtype).T
        if self.bias is not None:
            logits = logits + self.bias[...].astype(x.dtype)
        probs = jax.nn.softmax(logits.astype(accumulation_dtype(x.dtype)), axis=-1)
        own_w, own_e = jax.lax.top_k(probs, self.top_k)
        top_w, top_e = own_w, own_e
        if replay is not None:
            replayed = replay[:, :1] >= 0
            top_e = jnp.where(replayed, replay, own_e).astype(own_e.dtype)
            top_w = jnp.take_along_axis(probs, top_e, axis=-1)
        if self.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        return top_w.astype(x.dtype), top_e, RouterStats(probs, own_e)


class GroupLimitedRouter(nnx.Module):
    """DeepSeek-V3's router (HF `DeepseekV3TopkRouter`), in float32 whatever the compute dtype
    (HF keeps it in float32): sigmoid scores s = sigmoid(x W^T); the choice adds the selection
    bias b (`e_score_correction_bias`, which DeepSeek tunes outside the gradient to balance the
    load); the experts split into `n_group` contiguous groups, each group scored by the sum of
    its two best s + b, and the top-`num_experts_per_tok` of s + b are taken among the experts
    of the `topk_group` best groups only. The weights are the chosen experts' s (not s + b),
    divided by their sum (+ 1e-20, as HF) when `norm_topk_prob`, times `scaling`
    (`routed_scaling_factor`). The bias never receives a gradient (it only orders experts); it
    is a parameter so that checkpoints load and save it, and the optimizer leaves it as it is
    (`jtree.step.optimizer`).

    `replay` [N, k] (routing replay, docs/rl.md): a replayed token's weights are the same
    function of the replayed experts' scores, so the router's gradient flows through them."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, *,
                 n_group: int, topk_group: int, scaling: float, init_std: float,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(init_std)
        self.weight = nnx.Param(init(rngs.params(), (num_experts, hidden), param_dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), param_dtype))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, scaling

    def __call__(self, x: jax.Array, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, RouterStats]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, experts [N, k], stats: the sigmoid
        scores and the router's own choice)."""
        f32 = accumulation_dtype(x.dtype)
        scores = jax.nn.sigmoid(x.astype(f32) @ self.weight[...].astype(f32).T)
        choice = jax.lax.stop_gradient(
            scores + self.e_score_correction_bias[...].astype(f32))
        n, experts = choice.shape
        grouped = choice.reshape(n, self.n_group, experts // self.n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        best_groups = jax.lax.top_k(group_score, self.topk_group)[1]
        eligible = jnp.any(jax.nn.one_hot(best_groups, self.n_group, dtype=jnp.bool_), axis=1)
        masked = jnp.where(eligible[:, :, None], grouped, -jnp.inf).reshape(n, experts)
        own_e = jax.lax.top_k(masked, self.top_k)[1]
        top_e = own_e
        if replay is not None:
            top_e = jnp.where(replay[:, :1] >= 0, replay, own_e).astype(own_e.dtype)
        top_w = jnp.take_along_axis(scores, top_e, axis=-1)
        if self.norm_topk_prob:
            top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + 1e-20)
        return (top_w * self.scaling).astype(x.dtype), top_e, RouterStats(scores, own_e)


class Experts(nnx.Module):
    """E SwiGLU experts stored as 3-D tensors (HF `*Experts`). gpt-oss's form: `bias` adds
    `gate_up_proj_bias` [E, 2 * intermediate] (gate first, like the rows of gate_up_proj) and
    `down_proj_bias` [E, hidden]; `clamp` = (alpha, limit) replaces silu(gate) * up by the
    clamped SwiGLU (`clamped_swiglu`). Nemotron 3's form (`relu2`): down(relu(up x)^2), no gate,
    `up_proj` [E, intermediate, hidden] in place of gate_up_proj (HF `NemotronHExperts`).
    `matmul` ("auto", "ragged_dot", "tiled"; `jtree.kernels.grouped_matmul.pick_grouped_matmul`)
    is how the sorted assignments meet their experts' weights: `jax.lax.ragged_dot`, or the
    tile loop that GPUs run instead of XLA:GPU's dense expansion of it (same values)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, *, init_std: float,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False,
                 clamp: tuple[float, float] | None = None, relu2: bool = False,
                 matmul: str = "auto"):
        init = nnx.initializers.normal(init_std)
        if relu2:
            self.up_proj = nnx.Param(
                init(rngs.params(), (num_experts, intermediate, hidden), param_dtype))
            self.gate_up_proj = nnx.data(None)
        else:
            self.gate_up_proj = nnx.Param(
                init(rngs.params(), (num_experts, 2 * intermediate, hidden), param_dtype))
            self.up_proj = nnx.data(None)
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), param_dtype))
        if bias:
            self.gate_up_proj_bias = nnx.Param(jnp.zeros((num_experts, 2 * intermediate),
                                                         param_dtype))
            self.down_proj_bias = nnx.Param(jnp.zeros((num_experts, hidden), param_dtype))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = nnx.data(None)
        self.clamp = clamp
        self.matmul = matmul

    def __call__(self, x: jax.Array, top_e: jax.Array, top_w: jax.Array,
                 axis: str | None = None) -> jax.Array:
        """sum_k top_w[:, k] * expert_{top_e[:, k]}(x), x [N, hidden]. With `axis` (expert
        parallel) this device holds experts [i * E_local, (i + 1) * E_local) and the sum runs over
        those only: the caller sums the partial outputs over `axis`."""
        n, k = top_e.shape
        local = self.down_proj.shape[0]  # experts stored on this device
        flat_e = top_e.reshape(-1)
        if axis is not None:
            flat_e = flat_e - jax.lax.axis_index(axis) * local
        mine = (flat_e >= 0) & (flat_e < local)
        # Other devices' assignments sort last, past the end of every expert's group.
        key = jnp.where(mine, flat_e, local)
        # A stable argsort through lax.sort: jnp.argsort's result loses the varying-over-mesh-axes
        # type of its key inside shard_map (jax 0.10), which silently breaks the gradient of x.
        _, order = jax.lax.sort((key, jnp.arange(key.shape[0], dtype=key.dtype)), num_keys=1)
        group_sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
        valid, weight = mine[order], top_w.reshape(-1)[order]
        if pick_grouped_matmul(self.matmul, jax.default_backend()) == "tiled":
            # every expert's rows padded to whole tiles (kernels/grouped_matmul.py); a padding
            # row reads the last sorted row, masked below
            layout = tile_layout(group_sizes, n * k)
            source = jnp.minimum(layout.source, n * k - 1)
            order = order[source]
            valid, weight = valid[source] & (layout.source < n * k), weight[source]
            row_expert = jnp.repeat(layout.expert, TILE)

            def matmul(a: jax.Array, w: jax.Array) -> jax.Array:
                return tiled_matmul(a, w.astype(x.dtype), layout.expert, layout.used)
        else:
            # each sorted row's expert (others' assignments: any local one, masked below)
            row_expert = jnp.minimum(key[order], local - 1)

            def matmul(a: jax.Array, w: jax.Array) -> jax.Array:
                return jax.lax.ragged_dot(a, jnp.swapaxes(w.astype(x.dtype), 1, 2), group_sizes)
        token = order // k
        w_in = self.gate_up_proj if self.up_proj is None else self.up_proj
        gate_up = matmul(x[token], w_in[...])
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[...].astype(x.dtype)[row_expert]
        if self.up_proj is not None:
            hidden = jnp.square(jax.nn.relu(gate_up))
        else:
            gate, up = jnp.split(gate_up, 2, axis=-1)
            hidden = (jax.nn.silu(gate) * up if self.clamp is None
                      else clamped_swiglu(gate, up, *self.clamp))
        y = matmul(hidden, self.down_proj[...])
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[...].astype(x.dtype)[row_expert]
        y = jnp.where(valid[:, None], y * weight[:, None], 0)
        return jnp.zeros_like(x).at[token].add(y)


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert activation (HF `GptOssExperts._apply_gate`): the gate clamped from above
    and the up projection on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def dispatch_to_experts(experts: Experts, x: jax.Array, top_e: jax.Array, top_w: jax.Array,
                        axis: str) -> jax.Array:
    """sum_k top_w[:, k] * expert_{top_e[:, k]}(x) for this device's tokens x [T, hidden], the
    experts split over `axis` (module docstring, token dispatch): each assignment goes to its
    expert's device in slot (destination, rank among this device's assignments to it) of a
    [devices, capacity, hidden] buffer, every slot comes back in place, and the results are
    combined here. Unused slots carry expert id `local` (no expert), so they compute nothing."""
    t, k = top_e.shape
    devices = jax.lax.axis_size(axis)
    local = experts.down_proj.shape[0]
    capacity = t * min(k, local)  # a token has at most min(k, local) experts on one device
    flat_e = top_e.reshape(-1)
    dest = flat_e // local
    sent_before = jnp.cumsum(jax.nn.one_hot(dest, devices, dtype=jnp.int32), axis=0)
    slot = jnp.take_along_axis(sent_before, dest[:, None], axis=1)[:, 0] - 1
    send = jnp.zeros((devices, capacity, x.shape[-1]), x.dtype).at[dest, slot].set(
        x[jnp.arange(t * k) // k])
    send_e = jnp.full((devices, capacity), local, flat_e.dtype).at[dest, slot].set(flat_e % local)

    def exchange(a: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(a, axis, 0, 0, tiled=True)

    recv, recv_e = exchange(send).reshape(-1, x.shape[-1]), exchange(send_e).reshape(-1, 1)
    y = experts(recv, recv_e, jnp.ones(recv_e.shape, x.dtype))
    back = exchange(y.reshape(send.shape))[dest, slot].reshape(t, k, -1)
    return jnp.einsum("tk,tkh->th", top_w, back)


class SparseMoeBlock(nnx.Module):
    """Router + experts, plus (Qwen3-Next) a shared SwiGLU expert scaled by sigmoid(shared gate).
    gpt-oss: `router_bias`, `expert_bias` and the experts' clamped SwiGLU (`clamp`, `Experts`).
    DeepSeekMoE: `grouped` = (n_group, topk_group, routed_scaling_factor) swaps in its router
    (`GroupLimitedRouter`) and `shared_gate=False` adds the shared expert ungated. Nemotron 3:
    that router and ungated shared expert, with `relu2` making the experts and the shared
    expert squared-ReLU MLPs without a gate (`Experts`, `ReluSquaredMLP`).
    `tp_axis`: expert parallel over that mesh axis, the experts run as `expert_dispatch` says
    ("psum" or "all_to_all", module docstring); `expert_matmul` is the experts' `matmul`."""

    def __init__(self, hidden: int, *, num_experts: int, top_k: int, moe_intermediate: int,
                 norm_topk_prob: bool, shared_intermediate: int | None, init_std: float,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs,
                 tp_axis: str | None = None, expert_dispatch: str = "psum",
                 router_bias: bool = False, expert_bias: bool = False,
                 clamp: tuple[float, float] | None = None,
                 grouped: tuple[int, int, float] | None = None, shared_gate: bool = True,
                 relu2: bool = False, expert_matmul: str = "auto"):
        kw = dict(init_std=init_std, param_dtype=param_dtype, rngs=rngs)
        if grouped is None:
            self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, bias=router_bias,
                                   **kw)
        else:
            n_group, topk_group, scaling = grouped
            # stored in float32 whatever the run's weight dtype, as transformers keeps them
            # (`_keep_in_fp32_modules_strict`): a bf16 selection bias would reorder near-tied
            # experts
            self.gate = GroupLimitedRouter(hidden, num_experts, top_k, norm_topk_prob,
                                           n_group=n_group, topk_group=topk_group,
                                           scaling=scaling, **{**kw, "param_dtype": jnp.float32})
        self.experts = Experts(hidden, moe_intermediate, num_experts, bias=expert_bias,
                               clamp=clamp, relu2=relu2, matmul=expert_matmul, **kw)
        if shared_intermediate is None:
            self.shared_expert = self.shared_expert_gate = None
        else:
            self.shared_expert = (ReluSquaredMLP if relu2 else SwiGLU)(
                hidden, shared_intermediate, dtype=dtype, tp_axis=tp_axis, **kw)
            self.shared_expert_gate = (linear(hidden, 1, bias=False, dtype=dtype, **kw)
                                       if shared_gate else None)
        self.tp_axis = tp_axis
        self.expert_dispatch = expert_dispatch

    def __call__(self, x: jax.Array, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats]:
        """x [..., hidden]; `replay` [..., k] the replayed experts of each token (-1: its own
        routing; `TopKRouter`), None: every token routed by the router."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if replay is not None:
            replay = replay.reshape(-1, replay.shape[-1])
        if self.tp_axis is not None and self.expert_dispatch == "all_to_all":
            out, stats = self._dispatched(flat, self.tp_axis, replay)
            return out.reshape(shape), stats
        top_w, top_e, stats = self.gate(flat, replay)
        out = self.experts(flat, top_e, top_w, self.tp_axis)
        if self.shared_expert is not None:
            out = out + self._shared_gate(flat) * self.shared_expert.unreduced(flat)
        if self.tp_axis is not None:
            out = jax.lax.psum(out, self.tp_axis)
        return out.reshape(shape), stats

    def _shared_gate(self, x: jax.Array) -> jax.Array | float:
        """Qwen3-Next's sigmoid gate on the shared expert's output (DeepSeek's has none: 1)."""
        if self.shared_expert_gate is None:
            return 1.0
        return jax.nn.sigmoid(self.shared_expert_gate(x))

    def _dispatched(self, flat: jax.Array, axis: str, replay: jax.Array | None
                    ) -> tuple[jax.Array, RouterStats]:
        """Token dispatch over `axis` (module docstring): `flat` [N, hidden] (and `replay`
        [N, k]) is the same on every device of the group; returns the whole output and the
        router statistics of all N tokens, the same on every device."""
        n, devices = flat.shape[0], jax.lax.axis_size(axis)
        per = -(-n // devices)

        def padded_rows(a: jax.Array, fill: float) -> jax.Array:
            return jnp.pad(a, ((0, per * devices - n), (0, 0)), constant_values=fill)

        def my_share(a: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(axis) * per, per)

        padded = padded_rows(flat, 0)
        mine = my_share(padded)
        top_w, top_e, stats = self.gate(
            mine, None if replay is None else my_share(padded_rows(replay, -1)))
        out = dispatch_to_experts(self.experts, mine, top_e, top_w, axis)
        if self.shared_expert is not None:
            shared = jax.lax.psum_scatter(self.shared_expert.unreduced(padded), axis, tiled=True)
            out = out + self._shared_gate(mine) * shared

        def gather(a: jax.Array) -> jax.Array:
            return jax.lax.all_gather(a, axis, tiled=True, to="invarying")[:n]

        return gather(out), RouterStats(*map(gather, stats))


def router_load(stats: list[RouterStats], token_weight: jax.Array,
                num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(counts [E], total): the token-weighted top-k assignments per expert pooled over layers,
    and L * sum of weights (f_e = counts_e / total). Both are constants of the parameters' routing
    (no gradient flows through top-k)."""
    w = token_weight.reshape(-1).astype(jnp.float32)
    counts = sum(jnp.einsum("n,nke->e", w, jax.nn.one_hot(s.top_experts, num_experts))
                 for s in stats)
    return jax.lax.stop_gradient(counts), len(stats) * jnp.sum(w)


def load_balancing_loss(stats: list[RouterStats], token_weight: jax.Array, num_experts: int,
                        data_axis: str | tuple[str, ...] | None = None,
                        pooled: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """HF's Switch-style aux loss pooled over layers, each token weighted by `token_weight` [N]
    (the path multiplicity on tree batches; 0 on padding). See the module docstring; with
    `data_axis` this shard's 1/shards share of the loss pooled over all shards.

    `pooled` = `router_load` of a larger forward this batch is one piece of (the parts of a tree
    split redundancy-free): the loss is then this piece's share E * sum_e f_e * P_piece_e, linear
    in its probabilities, and the shares of all pieces add up to the loss of the whole forward,
    value and gradient (no collective: the pooled load already covers every piece)."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    w = token_weight.reshape(-1).astype(jnp.float32)
    counts, total = router_load(stats, token_weight, num_experts) if pooled is None else pooled
    prob_sum = sum(jnp.einsum("n,ne->e", w, s.probs) for s in stats)
    shards = 1
    if data_axis is not None and pooled is None:
        total, counts, prob_sum = jax.lax.psum((total, counts, prob_sum), data_axis)
        shards = jax.lax.psum(1, data_axis)
    safe = jnp.maximum(total, 1e-30)
    return num_experts * jnp.sum((counts / safe) * (prob_sum / safe)) / shards


