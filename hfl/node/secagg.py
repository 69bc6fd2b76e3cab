"""Secure aggregation at the lowest servers (issue 52 item 2): Flower's SecAgg+ arithmetic, shared by
simulation and deployment.

In a deployment a lowest node server runs Flower's ``SecAggPlusWorkflow`` with its devices
(``hfl.deploy.secagg``): each device uploads ``[q_ratio, quantize(p * q_ratio / T)]`` plus masks, and
the server learns only the masked vectors' sum, from which it reconstructs the weighted mean. The
masks cancel exactly modulo ``modulus_range``, so here, in simulation, the same sum is computed
without them from the same quantization (Flower's ``quantize`` / ``dequantize`` and the mod's ratio
arithmetic), and the result is the one the workflow computes. Flower's quantization rounds
stochastically from NumPy's global generator; both paths seed it with ``rounding_seed`` (the run's
seed, the device, the round), so a deployment and the in-process run agree bit for bit.

Every reply of a round then carries the same model, the quantized weighted mean, with its own
``num_examples`` and metrics, as the workflow hands them to a strategy: the node's rule, a
sample-weighted mean of its children's models, returns that mean (within float rounding).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import (
    FitIns,
    FitRes,
    NDArrays,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine,
    factor_extract,
    parameters_mod,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.server.client_proxy import ClientProxy

from hfl.errors import ConfigError
from hfl.seed import derive_seed

SEED_KEY = "secagg_seed"  # the FitIns config entry a deployed device seeds its rounding with
CLIP_MARK = "secagg_clipping_range"  # in a device's refusal, so that its node stops the run (not a dropout)


class SecAggOverflow(RuntimeError):
    """A model value the quantization would clip, or a sum that would wrap around the modulus:
    the run stops rather than go on with a wrong mean."""


@dataclass(frozen=True)
class SecAggSettings:
    """``privacy.secagg_*``: SecAggPlusWorkflow's parameters (Flower's defaults but the shares)."""

    num_shares: int | float = 3
    reconstruction_threshold: int | float = 2
    clipping_range: float = 8.0
    quantization_range: int = 4194304  # 2**22
    modulus_range: int = 4294967296  # 2**32
    max_weight: float = 1000.0

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> SecAggSettings | None:
        """The run's settings, or None when ``privacy.secure_aggregation`` is off."""
        privacy = cfg.get("privacy") or {}
        if not privacy.get("secure_aggregation"):
            return None
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = privacy.get(f"secagg_{key}")
            return default if value is None else value

        def share(key: str, default: float) -> int | float:
            value = get(key, default)  # an int is a count, a float a fraction (Flower's convention)
            return value if isinstance(value, int | float) and not isinstance(value, bool) else float(value)

        return cls(share("num_shares", d.num_shares), share("reconstruction_threshold", d.reconstruction_threshold),
                   float(get("clipping_range", d.clipping_range)), int(get("quantization_range", d.quantization_range)),
                   int(get("modulus_range", d.modulus_range)), float(get("max_weight", d.max_weight)))

    def q_ratio(self, num_examples: int) -> int:
        """A device's quantized weight, as ``secaggplus_mod`` computes it."""
        return round(num_examples / self.max_weight * self.quantization_range)

    def threshold(self, sampled: int) -> int:
        """The reconstruction threshold for ``sampled`` devices, as the workflow's setup stage sets it."""
        if isinstance(self.num_shares, float):
            shares = round(self.num_shares * sampled)
            if shares < sampled and shares & 1 == 0:
                shares += 1
            if shares <= 2:
                shares = sampled
        else:
            shares = self.num_shares
        if isinstance(self.reconstruction_threshold, float):
            return max(round(self.reconstruction_threshold * shares), 2)
        return self.reconstruction_threshold


def rounding_seed(seed: int, path: str, cid: str, round_path: str) -> int:
    """The seed of a device's stochastic rounding in one round (the same in every runtime)."""
    return derive_seed(seed, "secagg", path, cid, round_path)


@contextmanager
def numpy_seeded(seed: int) -> Iterator[None]:
    """NumPy's global generator seeded for Flower's ``_stochastic_round``, then put back as it was."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


def check_fits(arrays: NDArrays, num_examples: int, s: SecAggSettings) -> None:
    """Refuse a reply whose weighted values leave ±clipping_range: Flower's quantization would clip
    them silently, and the mean would be wrong."""
    ratio = s.q_ratio(num_examples) / s.quantization_range
    largest = max((float(np.max(np.abs(a))) for a in arrays if np.size(a)), default=0.0)
    if largest * ratio > s.clipping_range:
        raise SecAggOverflow(
            f"{CLIP_MARK}: a model value {largest:.4g} weighted by {ratio:.4g} ({num_examples} samples / max_weight "
            f"{s.max_weight:g}) leaves +-{s.clipping_range:g}; raise privacy.secagg_clipping_range or "
            "privacy.secagg_max_weight")


def contribution(arrays: NDArrays, num_examples: int, s: SecAggSettings) -> list[np.ndarray]:
    """What a device's ``secaggplus_mod`` adds to the sum before its masks: ``[q_ratio, quantized
    p x q_ratio / T]`` (Flower's own arithmetic; seed NumPy's generator first for the rounding)."""
    q_ratio = s.q_ratio(num_examples)
    dq_ratio = q_ratio / s.quantization_range
    return factor_combine(q_ratio, quantize([a * dq_ratio for a in arrays], s.clipping_range, s.quantization_range))


def add(total: list[np.ndarray] | None, part: list[np.ndarray]) -> list[np.ndarray]:
    """The running sum of contributions, in int64 as the workflow's (masks are int64)."""
    part = [np.asarray(a, dtype=np.int64) for a in part]
    return part if total is None else [a + b for a, b in zip(total, part, strict=True)]


def check_sum(count: int, total_q_ratio: int, s: SecAggSettings) -> None:
    """Refuse a round whose sum wraps around the modulus (the workflow would return garbage)."""
    if count * s.quantization_range >= s.modulus_range or total_q_ratio >= s.modulus_range:
        raise SecAggOverflow(
            f"privacy.secagg_modulus_range: {count} devices' quantized sum (each up to {s.quantization_range}, weights "
            f"{total_q_ratio} in all) wraps around {s.modulus_range}; raise it or lower secagg_quantization_range / "
            "raise secagg_max_weight")


def unmasked_mean(total: list[np.ndarray], count: int, s: SecAggSettings) -> NDArrays:
    """The weighted mean from the sum of ``count`` devices' contributions: the workflow's unmask
    stage, step for step, so that the floats are the same."""
    recon = parameters_mod(total, s.modulus_range)
    q_total_ratio, recon = factor_extract(recon)
    inv_dq_total_ratio = s.quantization_range / q_total_ratio
    aggregated = dequantize(recon, s.clipping_range, s.quantization_range)
    offset = -(count - 1) * s.clipping_range
    for vec in aggregated:
        vec += offset
        vec *= inv_dq_total_ratio
    return aggregated


def as_sent(mean: NDArrays, sent: NDArrays) -> NDArrays:
    """The mean (float64 from dequantize) in the dtypes of the model the node sent, array by array
    where the shapes agree; the same in simulation and deployment, which never sees a device's reply."""
    if len(mean) != len(sent) or any(m.shape != np.shape(a) for m, a in zip(mean, sent, strict=True)):
        return mean
    return [m.astype(np.asarray(a).dtype, copy=False) for m, a in zip(mean, sent, strict=True)]


def error_bound(num_examples: Sequence[int], largest: float, s: SecAggSettings) -> float:
    """An upper bound on |quantized weighted mean - exact weighted mean| per value for one round of
    ``num_examples`` devices whose values are at most ``largest`` in size: per device, the stochastic
    rounding (< 1 step) and NumPy's float32 arithmetic before it (< 1 step), each step 2C/T of the
    weighted value; the weights rounded to q_ratio / T (< 1/2T each); the cast back to float32."""
    q_total = sum(s.q_ratio(n) for n in num_examples)
    n = len(num_examples)
    rounding = n * 2 * 2 * s.clipping_range / q_total  # 2 steps of 2C/T, over sum(q_ratio)/T
    weights = n * largest / q_total  # |sum(d_i p_i)| / sum(q_i/T) with |d_i| <= 1/2T, twice
    return rounding + weights + largest * 2.0 ** -23


def quantized_mean(calls: Sequence[tuple[ClientProxy, FitIns]], outcomes: Sequence[FitRes | BaseException],
                   s: SecAggSettings, seed: int, path: str) -> list[FitRes | BaseException]:
    """The round as SecAgg+ ends it, without the masks: every device that replied gets the quantized
    weighted mean of all who replied in place of its own model; failures stay failures."""
    from flwr.common import Code

    ok = [i for i, res in enumerate(outcomes) if isinstance(res, FitRes) and res.status.code == Code.OK]
    if not ok:
        return list(outcomes)
    threshold = s.threshold(len(calls))
    if len(calls) < 2 or len(ok) < threshold:
        why = (f"secure aggregation needs at least 2 devices a round, this round asked {len(calls)}" if len(calls) < 2
               else f"secure aggregation halted: {len(ok)} of {len(calls)} devices replied, fewer than its "
                    f"reconstruction threshold {threshold}")
        return [RuntimeError(why) if i in ok else res for i, res in enumerate(outcomes)]
    total = None
    total_q_ratio = 0
    for i in ok:
        res = outcomes[i]
        meta = res.metrics
        if str(meta.get("payload", "model")) != "model":
            raise SecAggOverflow(f"privacy.secure_aggregation: a device replied a {meta.get('payload')!r} payload; "
                                 "secure aggregation averages one model per device")
        arrays = parameters_to_ndarrays(res.parameters)
        check_fits(arrays, res.num_examples, s)
        proxy, ins = calls[i]
        with numpy_seeded(rounding_seed(seed, path, proxy.cid, str(ins.config.get("round_path", "")))):
            total = add(total, contribution(arrays, res.num_examples, s))
        total_q_ratio += s.q_ratio(res.num_examples)
    check_sum(len(ok), total_q_ratio, s)
    mean = as_sent(unmasked_mean(total, len(ok), s), parameters_to_ndarrays(calls[ok[0]][1].parameters))
    parameters = ndarrays_to_parameters(mean)
    out = list(outcomes)
    for i in ok:
        res = outcomes[i]
        out[i] = FitRes(res.status, parameters, res.num_examples, res.metrics)
    return out


def secagg_fit_many(fit_many: Any, s: SecAggSettings, seed: int, path: str) -> Any:
    """A lowest node's ``FitMany`` (one by one, or batched) whose replies come back as SecAgg+ would
    leave them: every device's model replaced by the round's quantized weighted mean."""

    def many(calls: list[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
        if len(calls) < 2:  # the workflow halts at its setup, before any device trains
            return [RuntimeError(f"secure aggregation needs at least 2 devices a round, this round asked {len(calls)}")
                    for _ in calls]
        return quantized_mean(calls, fit_many(calls), s, seed, path)

    return many


def check_secure_aggregation(cfg: Mapping[str, Any], tree: Any) -> None:
    """Refuse, in one line naming the key, what secure aggregation at the lowest servers cannot go
    with: a node step that needs its devices' individual replies, an unweighted mean, central DP at
    the lowest servers (it clips each update), a lowest level's clock policy that merges late
    replies, Flower's parameter constraints, and teams too small to mask."""
    privacy = cfg.get("privacy") or {}
    value = privacy.get("secure_aggregation")
    if value is None or value is False:
        return
    if not isinstance(value, bool):
        raise ConfigError("privacy.secure_aggregation", f"must be true or false, got {value!r}")
    from hfl.config.checks import load_server

    depth = tree.depth
    s = SecAggSettings.of(cfg)
    assert s is not None
    try:  # Flower's own checks of the workflow's parameters
        from flwr.server.workflow import SecAggPlusWorkflow

        SecAggPlusWorkflow(s.num_shares, s.reconstruction_threshold, max_weight=s.max_weight,
                           clipping_range=s.clipping_range, quantization_range=s.quantization_range,
                           modulus_range=s.modulus_range)
    except (TypeError, ValueError) as exc:  # the key its message names first (Flower's words: `num_shares`, ...)
        names = ("reconstruction_threshold", "num_shares", "max_weight", "quantization_range", "modulus_range")
        named = min((str(exc).find(f"`{n}`"), n) for n in names if f"`{n}`" in str(exc))[1] if "`" in str(exc) \
            else "num_shares"
        raise ConfigError(f"privacy.secagg_{named}", f"SecAgg+ refuses its parameters: {exc}") from None
    if s.clipping_range <= 0:
        raise ConfigError("privacy.secagg_clipping_range", f"must be > 0, got {s.clipping_range}")
    alg = cfg["algorithm"]
    server = load_server(alg)
    name = alg.get("name")
    if server.reply_kind != "model" or not server.level_models:
        raise ConfigError("privacy.secure_aggregation", f"{name}'s lowest servers need their devices' individual "
                                                        "replies (gradients, cluster picks or relayed models), not "
                                                        "their sum")
    if int(alg.get("residual_up_k") or 0) > 0:
        raise ConfigError("algorithm.residual_up_k", "secure aggregation: residual edges forward individual "
                                                     "children's models, which a lowest server no longer sees (use 0)")
    if alg.get("residual_down"):
        raise ConfigError("algorithm.residual_down", "secure aggregation: residual edges need individual "
                                                     "children's models, which a lowest server no longer sees")
    if "weighted" in alg and not alg["weighted"]:
        raise ConfigError("algorithm.weighted", "secure aggregation returns the sample-weighted mean (SecAgg+ "
                                                "weights by num_examples): use algorithm.weighted=true")
    level = privacy.get("level")
    text = str(level).lower()
    if level is not False and (text == "lowest" or (isinstance(level, int) and not isinstance(level, bool)
                                                    and level == depth - 1)):
        raise ConfigError("privacy.level", "central DP at the lowest servers clips each device's update, which a "
                                           "server under secure aggregation never sees: use local DP or a higher level")
    clock = cfg.get("clock") or {}
    if clock.get("enabled"):
        from hfl.clock.policy import LevelPolicy

        if cfg["runtime"].get("name") == "deployment":
            raise ConfigError("clock.enabled", "secure aggregation: a deployed lowest server runs SecAgg+'s stages "
                                               "over its devices, not the clock's real-time policies")
        policy = LevelPolicy.for_level(clock, depth - 1)
        if policy.kind != "sync":
            raise ConfigError("clock.policy", f"{policy.kind} at the lowest level merges late replies one by one; "
                                              "under secure aggregation a round's devices are summed together (sync)")
    fewest = min(len(tree.devices(p)) for p in tree.inner_paths if tree.is_lowest(p))
    if fewest < 2:
        raise ConfigError("privacy.secure_aggregation", f"a lowest server has {fewest} device(s); SecAgg+ masks "
                                                        "need at least 2 a round")
