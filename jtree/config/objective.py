"""The `objective` and `optim` sections: what the step minimizes (SFT, PPO, GSPO; advantages; the
critic) and the optimizer that follows its gradient. Types only: the losses are
`jtree.objectives`, the optimizer `jtree.step.optimizer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from jtree.config.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    UNIT_INTERVAL,
    Domain,
    check_domains,
    within,
)

# Adam's moment decay rates: 1 would never forget the first gradient.
_DECAY_RATE = Domain(low=0, high=1, high_open=True)

Estimator = Literal["given", "grpo", "dr_grpo", "rloo", "tree", "turn"]


ESTIMATORS: tuple[str, ...] = get_args(Estimator)


Normalization = Literal["seq_mean_token_mean", "seq_mean_token_sum", "token_mean"]


NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)


CRITIC_SOURCES = ("policy", "random")


OffPolicyKind = Literal["none", "tis", "mis", "seq_tis", "seq_mis", "seq_mask"]


OFF_POLICY_KINDS: tuple[str, ...] = get_args(OffPolicyKind)


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """`objective.off_policy`: the correction for the gap between the rollout engine's behavior
    log-probs mu (the data's `old_logprobs`) and the trainer's own old log-probs pi_old, as an
    importance weight on each trained token's surrogate term (`jtree.layout.off_policy`,
    docs/rl.md "Off-policy correction"). With r = exp(pi_old - mu): `tis` weighs by min(r, cap),
    `mis` by r inside [low, high] and 0 outside; `seq_tis` / `seq_mis` do the same with one
    ratio per path, the geometric mean of r over the path's trained tokens; `seq_mask` keeps a
    path (weight 1) while that geometric mean lies inside [low, high] and drops it (weight 0)
    outside, a mask without reweighting. Truncation reads only `cap`, masking only `low` and
    `high`, so a key the kind ignores is refused rather than silently unused.

    `kl_mask_delta`: DeepSeek-V3.2's off-policy sequence masking, on top of any kind (also
    `none`): a path's terms with a negative advantage are dropped when the path's mean
    mu - pi_old over its trained tokens (the k1 estimate of KL(mu || pi_old)) exceeds delta,
    so the policy is not pushed away from samples it has drifted far from."""

    kind: OffPolicyKind = "none"
    cap: float | None = within(POSITIVE, None)
    low: float | None = within(NON_NEGATIVE, None)
    high: float | None = within(POSITIVE, None)
    kl_mask_delta: float | None = within(NON_NEGATIVE, None)

    def __post_init__(self) -> None:
        check_domains(self)
        if self.kind not in OFF_POLICY_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {OFF_POLICY_KINDS}")
        wants = {"none": (), "tis": ("cap",), "seq_tis": ("cap",), "mis": ("low", "high"),
                 "seq_mis": ("low", "high"), "seq_mask": ("low", "high")}[self.kind]
        for name in ("cap", "low", "high"):
            value = getattr(self, name)
            if name in wants and value is None:
                raise ValueError(f"{name}: needed by kind {self.kind!r}")
            if name not in wants and value is not None:
                raise ValueError(f"{name}: not read by kind {self.kind!r} (truncation reads "
                                 "cap, masking reads low and high)")
        if self.low is not None and not self.low < self.high:
            raise ValueError(f"low, high: [{self.low}, {self.high}] must satisfy 0 <= low < high")

    @property
    def enabled(self) -> bool:
        """Whether any correction applies (a weighting kind or the KL sequence mask)."""
        return self.kind != "none" or self.kl_mask_delta is not None

    @property
    def setting(self) -> str:
        """The key that turns the correction on, as errors name it: `kind=...`, or
        `kl_mask_delta=...` for the KL sequence mask alone."""
        return f"kind={self.kind}" if self.kind != "none" else \
            f"kl_mask_delta={self.kl_mask_delta}"

    @property
    def sequence_level(self) -> bool:
        """Whether one weight per path (from the geometric-mean ratio) applies to all its
        tokens."""
        return self.kind.startswith("seq_")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """`objective.critic`: GAE's discount `gamma` and `lam` (lambda), the value loss's weight
    `value_coef` and clip range `value_clip` (the new value is clipped to old +- value_clip), and
    where the values come from: `model: head` (a linear value head on the policy trunk) or
    `model: separate` (a model of its own with a value head, run on the same linearized batch).

    A separate critic's `network` is its model section (`architecture` and that architecture's
    config fields; unset: the policy's model; the fields given override the policy's config when
    the architecture is the policy's, else that architecture's defaults; `jtree.config` resolves
    the mapping into the architecture's config instance) and `init_from` its
    trunk's starting weights: `policy` (a copy of the policy's starting weights; needs the
    policy's network), `random` (the seeded init) or a Hugging Face checkpoint directory.
    `learning_rate`: the peak learning rate of the critic's own parameters (the value head, or
    the separate critic), on the policy's warmup and decay schedule (unset: the policy's)."""

    gamma: float = within(UNIT_INTERVAL, 1.0)
    lam: float = within(UNIT_INTERVAL, 1.0)
    value_coef: float = within(NON_NEGATIVE, 0.5)
    value_clip: float = within(NON_NEGATIVE, 0.2)
    model: Literal["head", "separate"] = "head"
    network: Any = None
    init_from: str = "policy"
    learning_rate: float | None = within(POSITIVE, None)

    def __post_init__(self) -> None:
        check_domains(self)
        if self.model not in ("head", "separate"):
            raise ValueError(f"model: {self.model!r} is not 'head' (a value head on the policy "
                             "trunk) or 'separate' (a critic model of its own)")
        if self.model == "head" and (self.network is not None or self.init_from != "policy"):
            key = "network" if self.network is not None else "init_from"
            raise ValueError(f"{key}: only for model: separate (the value head sits on the "
                             "policy trunk: it has no network or weights of its own to load)")
        if not (self.network is None or isinstance(self.network, Mapping)
                or dataclasses.is_dataclass(self.network)):
            raise ValueError(f"network: expected a mapping (architecture and config fields), "
                             f"got {type(self.network).__name__}")

    @property
    def separate(self) -> bool:
        """Whether the values come from a critic model of its own."""
        return self.model == "separate"

    @property
    def checkpoint_dir(self) -> str | None:
        """The Hugging Face checkpoint a separate critic starts from (None: `policy`/`random`)."""
        return None if self.init_from in CRITIC_SOURCES else self.init_from


DistillEstimator = Literal["sampled", "full"]


DISTILL_ESTIMATORS: tuple[str, ...] = get_args(DistillEstimator)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """`objective.distill`: on-policy distillation, the per-token reverse KL from the policy pi_s
    to a teacher pi_t, KL(pi_s || pi_t), on the trained tokens (sampled by the policy), added to
    the objective's loss with weight `coef` (`jtree.objectives.losses.distill_loss`; docs/rl.md,
    "On-policy distillation"). `teacher` is a Hugging Face checkpoint directory with the
    policy's vocabulary (the same tokenizer): its log-probs of the batch's tokens come from one
    forward over the step's tree batch, each shared prefix scored once, as the reference
    model's do. Reverse KL because the samples are the policy's: it is the expectation under
    them, and it pulls the policy toward the teacher's modes rather than spreading it over
    everything the teacher allows.

    `estimator`: `sampled` (default) scores the sampled token alone, k_t = log pi_s(y_t) -
    log pi_t(y_t), with the policy-gradient gradient; the teacher gives one log-prob per token.
    `full` sums over the whole vocabulary, sum_v pi_s(v) (log pi_s(v) - log pi_t(v)), exact
    rather than sampled and differentiated directly; the teacher gives its whole log-softmax
    per token of the batch (vocab floats each), so it is for small vocabularies and rows, on a
    mesh without tensor or context parallelism."""

    teacher: str = ""  # required: the section is refused without it
    coef: float = within(POSITIVE, 1.0)
    estimator: DistillEstimator = "sampled"

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.teacher:
            raise ValueError("teacher: expected a Hugging Face checkpoint directory")
        if self.estimator not in DISTILL_ESTIMATORS:
            raise ValueError(f"estimator: {self.estimator!r} is not one of {DISTILL_ESTIMATORS}")


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the step minimizes. `sft`: weighted NLL. `ppo`: clipped token-level surrogate (+ KL,
    entropy). `gspo`: GSPO's clipped sequence-level surrogate (`jtree.objectives.losses.gspo_loss`; its paper
    clips at 3e-4 / 4e-4). `advantage`: where the RL objectives' advantages come from
    (`jtree.objectives.advantages`: the records' own, or computed from their rewards; `turn_discount` is
    the `turn` estimator's discount over later turns); `critic`: PPO with a value head and
    per-path GAE instead (`jtree.objectives.critic`); `off_policy`: importance weights for the
engine-vs-trainer gap (`OffPolicyConfig`). See docs/rl.md.

    `reference`: where the KL term's reference log-probs come from: None reads them from the
    data, `initial` runs the run's starting weights and a directory runs that Hugging Face
    checkpoint, on each step's batch (`jtree.training.trainer`; docs/training.md).

    `distill`: on-policy distillation toward a teacher model (`DistillConfig`), a term of the
    RL objectives' loss like the KL term: alone when the data's advantages are 0, else mixed
    with the reward objective.

    `temperature`: the rollout engine's sampling temperature T. The RL objectives' log-probs,
    ratios, KL and entropy are those of softmax(logits / T), the distribution the engine sampled
    from and (set to report processed log-probs) scored; with T != 1 the raw softmax would put
    every ratio off by the tempering (docs/rl.md, "Sampling temperature"). SFT refuses T != 1:
    its NLL fits the model's own distribution, which sampling settings do not change.

    `routing_replay`: MoE layers use the rollout engine's expert choice per token (the traces'
    `routed_experts`) instead of their own top-k (docs/rl.md, "Routing replay"); off by default,
    checked against the model, data format and mode in `jtree.config.run.TrainConfig`
    and against the data in `jtree.training.run_data`.

    `mtp_weight`: multi-token prediction (`jtree.models.mtp`, docs/design.md): the loss adds
    mtp_weight / mtp_depth times the MTP heads' cross-entropies, each token weighted by its SFT
    weight W (DeepSeek-V3's lambda / D); 0 (the default) builds no MTP modules. `mtp_depth`:
    how many tokens past the next one the heads predict (one MTP layer each)."""

    kind: Literal["sft", "ppo", "gspo"] = "sft"
    advantage: Estimator = "given"
    turn_discount: float = within(UNIT_INTERVAL, 1.0)
    critic: CriticConfig | None = None
    normalization: Normalization = "seq_mean_token_mean"
    clip_low: float = within(NON_NEGATIVE, 0.2)
    clip_high: float = within(NON_NEGATIVE, 0.2)
    kl_coef: float = within(NON_NEGATIVE, 0.0)
    entropy_coef: float = within(NON_NEGATIVE, 0.0)
    logprob_chunk: int = within(AT_LEAST_ONE, 1024)
    temperature: float = within(POSITIVE, 1.0)
    old_logprob_tolerance: float = within(NON_NEGATIVE, 1e-3)
    reference: str | None = None
    off_policy: OffPolicyConfig = OffPolicyConfig()
    distill: DistillConfig | None = None
    routing_replay: bool = False
    mtp_weight: float = within(NON_NEGATIVE, 0.0)
    mtp_depth: int = within(AT_LEAST_ONE, 1)

    def __post_init__(self) -> None:
        check_domains(self)
        self._check_off_policy()
        if self.kind == "sft" and self.temperature != 1.0:
            raise ValueError(f"temperature: {self.temperature} tempers the log-probs of the RL "
                             "objectives; sft fits the model's own distribution (leave it 1)")
        if self.distill is not None and self.kind == "sft":
            raise ValueError("distill: needs an RL objective (kind ppo or gspo): its KL is an "
                             "expectation under the policy, so the trained tokens must be the "
                             "policy's samples, not sft's given text")
        if self.critic is not None and self.kind != "ppo":
            raise ValueError(f"critic: needs kind 'ppo', not {self.kind!r}")
        if self.critic is not None and self.advantage != "given":
            raise ValueError(f"advantage: {self.advantage!r} with a critic (the critic's GAE "
                             "gives the advantages; leave objective.advantage unset)")
        if self.mtp_depth != 1 and not self.mtp_weight:
            raise ValueError(f"mtp_depth: {self.mtp_depth} is read only with mtp_weight > 0")
        if self.turn_discount != 1.0 and self.advantage != "turn":
            raise ValueError(f"turn_discount: {self.turn_discount} discounts the turns of "
                             f"advantage 'turn', not {self.advantage!r}")

    def _check_off_policy(self) -> None:
        """The objectives the off-policy weights and masks fold into exactly (docs/rl.md)."""
        kind = self.off_policy.kind
        if not self.off_policy.enabled:
            return
        key = f"off_policy.{self.off_policy.setting}"
        if self.kind == "sft":
            raise ValueError(f"{key} weighs a policy-gradient surrogate; objective.kind 'sft' "
                             "has none")
        if self.kind == "gspo" and kind != "none" and not self.off_policy.sequence_level:
            raise ValueError(f"{key} weighs single tokens, but gspo has one ratio per path; use "
                             "seq_tis, seq_mis or seq_mask")
        if self.critic is not None:
            raise ValueError(f"{key} with a critic: not implemented (the weights would multiply "
                             "the GAE advantages the step forms per pair)")

    @property
    def advantage_estimator(self) -> Estimator | None:
        """The estimator every tree's advantages come from; None when the objective needs none
        (SFT) or computes them in the step (a critic's GAE)."""
        return None if self.kind == "sft" or self.critic is not None else self.advantage


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warmup + cosine learning-rate schedule."""

    learning_rate: float = within(POSITIVE, 3e-4)
    warmup_steps: int = within(NON_NEGATIVE, 10)
    decay_steps: int = within(AT_LEAST_ONE, 1000)
    min_lr_ratio: float = within(UNIT_INTERVAL, 0.1)
    weight_decay: float = within(NON_NEGATIVE, 0.0)
    b1: float = within(_DECAY_RATE, 0.9)
    b2: float = within(_DECAY_RATE, 0.95)
    eps: float = within(POSITIVE, 1e-8)
    clip_norm: float = within(POSITIVE, 1.0)

    def __post_init__(self) -> None:
        check_domains(self)
