"""Losses, their metrics and the advantage estimators against values computed by hand on tiny tensors.

The standard batch: 5 policy tokens and 1 environment token (index 5). Per policy token, the PPO ratio
r = exp(logprobs - old_logprobs), the advantage A, and the behaviour weight w = exp(old_logprobs - behav_logprobs):
    token  r     A    -min(rA, clip(r, 0.8, 1.2) A)        clip active?
    0      1.1   2    -min(2.2, 2.2)  = -2.2              no   (inside the range)
    1      1.5   1    -min(1.5, 1.2)  = -1.2              yes  (A > 0, r above 1.2)
    2      0.5  -1    -min(-0.5, -0.8) = 0.8              yes  (A < 0, r below 0.8)
    3      0.9  -1    -min(-0.9, -0.9) = 0.9              no
    4      0.5   1    -min(0.5, 0.8)  = -0.5              no   (the min is one-sided: A > 0, r low still trains)
The environment token holds values that would change every number if it were counted (A = 10, r = 3, w = 100).
"""

import math

import pytest
import torch

from tandem.trainer.advantages import ADVANTAGES, grpo_advantages, rloo_advantages
from tandem.trainer.losses import LOSSES, LossConfig, LossInput, decoupled_ppo, get_loss, ppo_clip, register_loss, tis

RATIO = [1.1, 1.5, 0.5, 0.9, 0.5, 3.0]
ADV = [2.0, 1.0, -1.0, -1.0, 1.0, 10.0]
MASK = [1, 1, 1, 1, 1, 0]
OLD = [-1.0, -2.0, -0.5, -3.0, -1.5, -0.7]
PG = [-2.2, -1.2, 0.8, 0.9, -0.5]  # per policy token, from the table above


def make_input(behav_w=(1.0, 0.5, 0.5, 0.5, 2.0, 100.0), ref_minus_lp=None, seq_lens=None, **overrides):
    logprobs = torch.tensor([o + math.log(r) for o, r in zip(OLD, RATIO, strict=True)], requires_grad=True)
    fields = dict(
        logprobs=logprobs,
        old_logprobs=torch.tensor(OLD),
        behav_logprobs=torch.tensor([o - math.log(w) for o, w in zip(OLD, behav_w, strict=True)]),
        advantages=torch.tensor(ADV),
        loss_mask=torch.tensor(MASK),
        ref_logprobs=None if ref_minus_lp is None else logprobs.detach() + torch.tensor(ref_minus_lp),
        seq_lens=seq_lens,
    )
    fields.update(overrides)
    return LossInput(**fields)


def test_ppo_clip_loss_and_metrics_by_hand():
    loss, m = ppo_clip(make_input(), LossConfig())
    assert loss.item() == pytest.approx((-2.2 - 1.2 + 0.8 + 0.9 - 0.5) / 5)
    assert m["loss"] == pytest.approx(-2.2 / 5)
    assert m["pg_loss"] == pytest.approx(-2.2 / 5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 0.9 + 0.5) / 5)
    assert m["ratio_min"] == pytest.approx(0.5)
    assert m["ratio_max"] == pytest.approx(1.5)
    # behaviour weights w = 1, 0.5, 0.5, 0.5, 2 on the policy tokens
    assert m["behav_weight_mean"] == pytest.approx(4.5 / 5)
    assert m["behav_weight_min"] == pytest.approx(0.5)
    assert m["behav_weight_max"] == pytest.approx(2.0)
    assert m["ess"] == pytest.approx(4.5**2 / (5 * (1 + 0.25 + 0.25 + 0.25 + 4)))
    # behav - old = -log w = 0, log 2, log 2, log 2, -log 2
    assert m["mismatch_kl"] == pytest.approx(2 * math.log(2) / 5)
    assert m["num_policy_tokens"] == 5
    assert "kl" not in m and "cap_frac" not in m


def test_ppo_clip_gradient_by_hand():
    inp = make_input()
    loss, _ = ppo_clip(inp, LossConfig())
    loss.backward()
    # d/dlogprob of -r*A is -r*A (dr/dlogprob = r); a token whose clip is active has zero gradient.
    expected = [-1.1 * 2 / 5, 0.0, 0.0, -0.9 * -1 / 5, -0.5 * 1 / 5, 0.0]
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor(expected))


def test_kl_penalty_value_and_gradient_by_hand():
    # ref - logprobs = d per token; k3 = e^d - d - 1: token 1 (d = log 2) 1 - log 2, token 2 (d = -log 2) log 2 - 0.5
    inp = make_input(ref_minus_lp=[0.0, math.log(2), -math.log(2), 0.0, 0.0, 7.0])
    loss, m = ppo_clip(inp, LossConfig(kl_coef=0.1))
    kl_mean = ((1 - math.log(2)) + (math.log(2) - 0.5)) / 5
    assert m["kl"] == pytest.approx(kl_mean)
    assert m["pg_loss"] == pytest.approx(-2.2 / 5)
    assert loss.item() == pytest.approx(-2.2 / 5 + 0.1 * kl_mean)
    loss.backward()
    # d k3 / d logprob = 1 - e^d: token 1 gives 1 - 2 = -1, token 2 gives 1 - 0.5 = 0.5
    expected = [-2.2 / 5, 0.1 * -1 / 5, 0.1 * 0.5 / 5, 0.9 / 5, -0.5 / 5, 0.0]
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor(expected))


def test_kl_is_reported_without_penalty_and_penalty_needs_ref():
    loss, m = ppo_clip(make_input(ref_minus_lp=[0.0, math.log(2), 0.0, 0.0, 0.0, 0.0]), LossConfig())
    assert m["kl"] == pytest.approx((1 - math.log(2)) / 5)
    assert loss.item() == pytest.approx(-2.2 / 5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_clip(make_input(), LossConfig(kl_coef=0.1))


# Behaviour weights 1, 0.5, 0.5, 1, 8 on the policy tokens: only token 4 exceeds a cap of 5 (or 2).
STALE_W = (1.0, 0.5, 0.5, 1.0, 8.0, 100.0)


def test_decoupled_ppo_truncate_by_hand():
    inp = make_input(behav_w=STALE_W)
    loss, m = decoupled_ppo(inp, LossConfig(behav_cap=5.0, behav_mode="truncate"))
    # weights after the cap: 1, 0.5, 0.5, 1, 5
    assert loss.item() == pytest.approx((-2.2 * 1 - 1.2 * 0.5 + 0.8 * 0.5 + 0.9 * 1 - 0.5 * 5) / 5)
    assert m["cap_frac"] == pytest.approx(1 / 5)
    assert m["behav_weight_max"] == pytest.approx(8.0)  # reported before the cap
    assert m["clip_frac"] == pytest.approx(2 / 5)
    loss.backward()
    # the weight multiplies the PPO gradient as a constant
    expected = [-2.2 * 1 / 5, 0.0, 0.0, 0.9 * 1 / 5, -0.5 * 5 / 5, 0.0]
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor(expected))


def test_decoupled_ppo_mask_drops_token_but_keeps_denominator():
    loss, m = decoupled_ppo(make_input(behav_w=STALE_W), LossConfig(behav_cap=5.0, behav_mode="mask"))
    assert loss.item() == pytest.approx((-2.2 * 1 - 1.2 * 0.5 + 0.8 * 0.5 + 0.9 * 1 + 0.0) / 5)
    assert m["cap_frac"] == pytest.approx(1 / 5)


def test_decoupled_ppo_cap_is_inclusive_and_can_be_disabled():
    # w exactly at the cap is kept as is; an infinite cap keeps w = 8
    at_cap = (1.0, 0.5, 0.5, 1.0, 5.0, 100.0)
    for mode in ("truncate", "mask"):
        loss, m = decoupled_ppo(make_input(behav_w=at_cap), LossConfig(behav_cap=5.0, behav_mode=mode))
        assert loss.item() == pytest.approx((-2.2 - 0.6 + 0.4 + 0.9 - 2.5) / 5)
        assert m["cap_frac"] == 0.0
    loss, m = decoupled_ppo(make_input(behav_w=STALE_W), LossConfig(behav_cap=math.inf))
    assert loss.item() == pytest.approx((-2.2 - 0.6 + 0.4 + 0.9 - 0.5 * 8) / 5)
    assert m["cap_frac"] == 0.0


def test_tis_by_hand():
    inp = make_input(behav_w=STALE_W)
    loss, m = tis(inp, LossConfig(tis_cap=2.0))
    # weights min(w, 2): 1, 0.5, 0.5, 1, 2
    assert loss.item() == pytest.approx((-2.2 * 1 - 1.2 * 0.5 + 0.8 * 0.5 + 0.9 * 1 - 0.5 * 2) / 5)
    assert m["cap_frac"] == pytest.approx(1 / 5)
    loss.backward()
    expected = [-2.2 / 5, 0.0, 0.0, 0.9 / 5, -0.5 * 2 / 5, 0.0]
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor(expected))


def test_on_policy_decoupled_and_tis_equal_ppo():
    on_policy = (1.0,) * 6
    expected, _ = ppo_clip(make_input(behav_w=on_policy), LossConfig())
    for fn in (decoupled_ppo, tis):
        loss, m = fn(make_input(behav_w=on_policy), LossConfig())
        assert loss.item() == pytest.approx(expected.item())
        assert m["ess"] == pytest.approx(1.0) and m["mismatch_kl"] == pytest.approx(0.0)


def test_gradient_flows_only_into_logprobs():
    old = torch.tensor(OLD, requires_grad=True)
    behav = torch.tensor(OLD, requires_grad=True)
    inp = make_input(old_logprobs=old, behav_logprobs=behav)
    for fn in LOSSES.values():
        fn(inp, LossConfig())[0].backward()
    assert old.grad is None and behav.grad is None


def test_seq_mean_aggregation_by_hand():
    # sequences [t0, t1] and [t2, t3, t4, t5]: means (-2.2 - 1.2) / 2 and (0.8 + 0.9 - 0.5) / 3
    loss, m = ppo_clip(make_input(seq_lens=[2, 4]), LossConfig(aggregation="seq_mean"))
    assert loss.item() == pytest.approx(((-2.2 - 1.2) / 2 + (0.8 + 0.9 - 0.5) / 3) / 2)
    assert m["clip_frac"] == pytest.approx(2 / 5)  # metrics stay token-level
    # a sequence of environment tokens only (t5) does not count as a sequence
    loss, _ = ppo_clip(make_input(seq_lens=[2, 3, 1]), LossConfig(aggregation="seq_mean"))
    assert loss.item() == pytest.approx(((-2.2 - 1.2) / 2 + (0.8 + 0.9 - 0.5) / 3) / 2)
    with pytest.raises(ValueError, match="seq_lens"):
        ppo_clip(make_input(), LossConfig(aggregation="seq_mean"))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_environment_tokens_never_matter(name):
    """Falsifier for the loss mask: rewriting the environment token (even to NaN / inf) changes nothing."""
    cfg = LossConfig(kl_coef=0.1, behav_cap=1.5, tis_cap=1.5)
    base = make_input(behav_w=STALE_W, ref_minus_lp=[0.1] * 6)
    loss, metrics = LOSSES[name](base, cfg)
    loss.backward()
    for junk in (-50.0, 50.0, math.nan, math.inf):
        lp = base.logprobs.detach().clone()
        lp[5] = junk
        lp.requires_grad_(True)
        env = {k: getattr(base, k).clone() for k in ("old_logprobs", "behav_logprobs", "advantages", "ref_logprobs")}
        for t in env.values():
            t[5] = junk
        changed = LossInput(lp, loss_mask=base.loss_mask, **env)
        loss2, metrics2 = LOSSES[name](changed, cfg)
        loss2.backward()
        assert loss2.item() == loss.item()
        assert metrics2 == metrics
        assert torch.equal(lp.grad, base.logprobs.grad) and lp.grad[5] == 0
    # the positive control: the same rewrite at a policy token does change the loss
    adv = base.advantages.clone()
    adv[3] = 50.0
    other, _ = LOSSES[name](LossInput(base.logprobs, base.old_logprobs, base.behav_logprobs, adv, base.loss_mask,
                                      base.ref_logprobs), cfg)
    assert other.item() != loss.item()


def test_mask_accepts_bool_int_float():
    losses = [ppo_clip(make_input(loss_mask=torch.tensor(MASK, dtype=dtype)), LossConfig())[0].item()
              for dtype in (torch.bool, torch.int64, torch.float32)]
    assert losses == pytest.approx([-2.2 / 5] * 3)


def test_no_policy_tokens_gives_zero_loss_and_metrics():
    inp = make_input(loss_mask=torch.zeros(6))
    for fn in LOSSES.values():
        loss, m = fn(inp, LossConfig())
        loss.backward()
        assert loss.item() == 0.0 and all(v == 0.0 for v in m.values())
    assert torch.equal(inp.logprobs.grad, torch.zeros(6))


@pytest.mark.parametrize("field, value", [
    ("logprobs", torch.zeros(2, 3)),
    ("logprobs", torch.zeros(0)),
    ("old_logprobs", torch.zeros(5)),
    ("behav_logprobs", torch.zeros(7)),
    ("advantages", torch.zeros(6, 1)),
    ("loss_mask", torch.ones(5)),
    ("loss_mask", torch.tensor([1, 1, 2, 0, 1, 0])),
    ("ref_logprobs", torch.zeros(4)),
    ("advantages", torch.zeros(6, dtype=torch.int64)),
    ("old_logprobs", [0.0] * 6),
    ("behav_logprobs", torch.tensor([0.0, math.nan, 0.0, 0.0, 0.0, 0.0])),
    ("advantages", torch.tensor([0.0, 0.0, 0.0, math.inf, 0.0, 0.0])),
    ("seq_lens", [2, 3]),
    ("seq_lens", [6, 0]),
    ("seq_lens", [2.0, 4.0]),
])
def test_bad_input_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        make_input(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("eps_low", -0.1), ("eps_low", 1.0), ("eps_high", -0.1), ("eps_high", math.nan), ("eps_high", math.inf),
    ("behav_cap", 0.5), ("behav_cap", True), ("tis_cap", 0.9), ("tis_cap", "2"), ("kl_coef", -1.0),
    ("behav_mode", "clip"), ("aggregation", "sum"),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


def test_registry():
    assert set(LOSSES) >= {"ppo_clip", "decoupled_ppo", "tis"}
    assert get_loss("tis") is tis
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo_clip")(ppo_clip)


# ---- advantages ----

def test_grpo_by_hand():
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1; group 1: all equal -> 0;
    # group 2: mean 2, std sqrt((4 + 4 + 0) / 2) = 2; a pair [0, 4]: mean 2, std sqrt((4 + 4) / 1) = 2 sqrt 2
    rewards_GN = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, 4.0, 2.0]])
    expected = [[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [-2 / 2, 2 / 2, 0.0]]
    torch.testing.assert_close(grpo_advantages(rewards_GN, eps=0.0), torch.tensor(expected))
    torch.testing.assert_close(grpo_advantages(torch.tensor([[0.0, 4.0]]), eps=0.0),
                               torch.tensor([[-2 / (2 * math.sqrt(2)), 2 / (2 * math.sqrt(2))]]))
    # eps keeps a constant group finite and shrinks the rest slightly
    torch.testing.assert_close(grpo_advantages(rewards_GN[:2], eps=0.5),
                               torch.tensor([[-1 / 1.5, 0.0, 1 / 1.5], [0.0, 0.0, 0.0]]))


def test_dr_grpo_does_not_divide_by_std():
    rewards_GN = torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(grpo_advantages(rewards_GN, scale_by_std=False),
                               torch.tensor([[-2.0, -1.0, 3.0], [-1 / 3, -1 / 3, 2 / 3]]))


def test_rloo_by_hand():
    rewards_GN = torch.tensor([[1.0, 2.0, 3.0], [0.0, 4.0, 8.0]])
    # r_i minus the mean of the other two
    expected = [[1 - (2 + 3) / 2, 2 - (1 + 3) / 2, 3 - (1 + 2) / 2],
                [0 - (4 + 8) / 2, 4 - (0 + 8) / 2, 8 - (0 + 4) / 2]]
    torch.testing.assert_close(rloo_advantages(rewards_GN), torch.tensor(expected))
    torch.testing.assert_close(rloo_advantages(torch.tensor([[0, 4]])), torch.tensor([[-4.0, 4.0]]))  # ints ok


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
@pytest.mark.parametrize("rewards, why", [
    (torch.zeros(4), "rank 2"),
    (torch.zeros(2, 2, 2), "rank 2"),
    (torch.zeros(3, 1), "n >= 2"),
    (torch.tensor([[0.0, math.nan]]), "finite"),
    (torch.tensor([[0.0, 1.0], [math.inf, 1.0]]), "finite"),
])
def test_advantage_bad_input(name, rewards, why):
    with pytest.raises(ValueError, match=f"rewards_GN.*{why}"):
        ADVANTAGES[name](rewards)
