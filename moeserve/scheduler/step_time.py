"""Predicts an engine step's wall time from its shape, learned online from measured steps.

The slo policy asks "how much prefill fits in this step without delaying the running streams past
their TBT target?", so it needs step time as a function of what the step computes. To first
order a step costs a sum of terms, each linear in one count:
- a fixed part: kernel launches, the sampler, the host round trip;
- batched tokens: every dense and expert GEMM runs once per token;
- sequences: per-sequence sampling and attention metadata;
- KV positions read: each sequence's attention streams its whole context, which bounds decode;
- query-key pairs: attention arithmetic, which bounds a long prefill chunk deep into its context.
The coefficients depend on the model, the GPU, the batch mix and even its clocks, so they are fitted
online: least squares over exponentially decayed sufficient statistics, solved for non-negative
coefficients. Non-negative, because no work takes negative time, and because then predicted time
grows with a chunk's length, so the largest chunk within a target can be found by bisection.
Decayed statistics, unlike recursive least squares, cannot wind up during long runs of
same-shaped decode steps that excite only some features; a small ridge keeps the split between
correlated features determined.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple


class StepShape(NamedTuple):
    """What one step computes, in the counts the cost model is linear in.

    A NamedTuple rather than a dataclass: the scheduler builds one per grant on its hot path.
    """

    num_tokens: int = 0
    num_seqs: int = 0
    num_kv_reads: int = 0
    """KV positions the step's attention reads: each sequence's context through its last new token."""
    num_attention_pairs: int = 0
    """(query, key) pairs attended: a chunk of n tokens from position s scores n*s + n(n+1)/2."""

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """The shape of a step feeding each `(num_tokens, start_position)` chunk."""
        shape = cls()
        for num_tokens, start_position in chunks:
            shape = shape.plus_chunk(num_tokens, start_position)
        return shape

    def plus_chunk(self, num_tokens: int, start_position: int) -> StepShape:
        """This step with one more sequence feeding `num_tokens` tokens from `start_position`."""
        return StepShape(
            self.num_tokens + num_tokens,
            self.num_seqs + 1,
            self.num_kv_reads + start_position + num_tokens,
            self.num_attention_pairs + num_tokens * start_position + num_tokens * (num_tokens + 1) // 2,
        )

    def features(self) -> tuple[float, ...]:
        """Regressors of the cost model: a constant 1 for the fixed cost, then the counts."""
        return (1.0, *map(float, self))


NUM_FEATURES = len(StepShape().features())


class StepTimeModel:
    """Step wall time ~= coefficients . features, refitted from every observed step.

    Each observation first decays all earlier ones by `forgetting`, so the fit follows the last
    ~1 / (1 - forgetting) steps and drifts with the workload and the GPU's clocks. Until it has
    observed `min_samples` steps, the model is not `ready` and callers should not act on it. Once
    ready, an observation is clipped to `outlier_ratio` times its prediction: a one-off stall
    (garbage collection, a kernel compiled on first use) then moves the fit by a bounded amount,
    while a lasting slowdown still pulls it up step after step.
    """

    def __init__(
        self,
        forgetting: float = 0.99,
        min_samples: int = 16,
        outlier_ratio: float = 2.0,
        ridge: float = 1e-6,
        tolerance_s: float = 1e-9,
    ) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if forgetting < 1.0 and min_samples > 1.0 / (1.0 - forgetting):
            raise ValueError(f"min_samples ({min_samples}) exceeds the ~1 / (1 - forgetting) steps the model remembers")
        if outlier_ratio <= 1.0 or ridge <= 0.0 or tolerance_s <= 0.0:
            raise ValueError("outlier_ratio must be > 1, and ridge and tolerance_s > 0")
        self.forgetting = forgetting
        self.min_samples = min_samples
        self.outlier_ratio = outlier_ratio
        self.ridge = ridge
        self.tolerance_s = tolerance_s
        self._num_observed = 0
        self._weight = 0.0  # sum of decayed sample weights
        self._gram = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]  # sum of w * x x^T
        self._moment = [0.0] * NUM_FEATURES  # sum of w * x * seconds
        self._coefficients = [0.0] * NUM_FEATURES
        self._stale = False  # observations arrived since the last solve

    @property
    def ready(self) -> bool:
        """Enough recent observations to act on the predictions."""
        return self._num_observed >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per unit of each `StepShape.features()` entry (all >= 0)."""
        self._solve()
        return tuple(self._coefficients)

    def predict(self, shape: StepShape) -> float:
        """Predicted wall time of a step of this shape, in seconds (>= 0; 0 before any observation)."""
        self._solve()
        return sum(c * x for c, x in zip(self._coefficients, shape.features()))

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """Learn from one measured step."""
        if not math.isfinite(duration_s) or duration_s < 0.0:
            raise ValueError(f"a step duration is a finite number of seconds >= 0, got {duration_s}")
        if self.ready:
            predicted = self.predict(shape)
            if predicted > 0.0:
                duration_s = min(duration_s, self.outlier_ratio * predicted)
        x = shape.features()
        decay = self.forgetting
        self._num_observed += 1
        self._weight = self._weight * decay + 1.0
        for i, xi in enumerate(x):
            row = self._gram[i]
            for j, xj in enumerate(x):
                row[j] = row[j] * decay + xi * xj
            self._moment[i] = self._moment[i] * decay + xi * duration_s
        self._stale = True

    def _solve(self) -> None:
        """Refit the coefficients if observations arrived since the last fit.

        The normal equations are solved with every feature scaled to unit (weighted) norm: the raw
        features span nine orders of magnitude (pairs run to 1e9, the constant is 1), the scaled
        system is well conditioned but for true collinearity, which the ridge then damps alike in
        every feature. Non-negativity survives a positive scaling.
        """
        if not self._stale:
            return
        self._stale = False
        gram = self._gram
        scale = [1.0 / math.sqrt(gram[j][j]) if gram[j][j] > 0.0 else 0.0 for j in range(NUM_FEATURES)]
        matrix = [
            [gram[i][j] * scale[i] * scale[j] + (self.ridge if i == j else 0.0) for j in range(NUM_FEATURES)]
            for i in range(NUM_FEATURES)
        ]
        rhs = [m * s for m, s in zip(self._moment, scale)]
        warm = [j for j in range(NUM_FEATURES) if self._coefficients[j] > 0.0]
        # A scaled gradient entry is at most sqrt(weight) times the residuals' RMS in seconds.
        solution = _nonnegative_solve(matrix, rhs, warm, self.tolerance_s * math.sqrt(self._weight))
        self._coefficients = [x * s for x, s in zip(solution, scale)]


def _nonnegative_solve(matrix: list[list[float]], rhs: list[float], warm: list[int], tolerance: float) -> list[float]:
    """argmin over x >= 0 of x.M.x / 2 - rhs.x for a positive definite M (Lawson-Hanson active set).

    First tries the previous fit's set of positive coefficients: after one more observation it is
    almost always still optimal, and checking costs one small solve.
    """
    if warm:
        x = _solve_on(matrix, rhs, warm)
        if all(x[j] > 0.0 for j in warm) and _is_optimal(matrix, rhs, x, warm, tolerance):
            return x
    n = len(rhs)
    x = [0.0] * n
    passive: list[int] = []
    for _ in range(3 * n):  # Lawson-Hanson ends in a few passes; the cap guards against rounding
        gradient = _gradient(matrix, rhs, x)
        entering = [j for j in range(n) if j not in passive and gradient[j] > tolerance]
        if not entering:
            break
        passive.append(max(entering, key=gradient.__getitem__))
        while True:
            z = _solve_on(matrix, rhs, passive)
            if all(z[j] > 0.0 for j in passive):
                x = z
                break
            # Step from x towards z until the first coefficient hits 0, and drop it (by index, so
            # that rounding can not leave it a hair above 0 and the loop always shrinks).
            ratios = {j: x[j] / (x[j] - z[j]) if x[j] > 0.0 else 0.0 for j in passive if z[j] <= 0.0}
            leaving = min(ratios, key=ratios.__getitem__)
            x = [xj + ratios[leaving] * (zj - xj) for xj, zj in zip(x, z)]
            passive = [j for j in passive if j != leaving and x[j] > 0.0]
            x = [xj if j in passive else 0.0 for j, xj in enumerate(x)]
            if not passive:
                break
    return x


def _gradient(matrix: list[list[float]], rhs: list[float], x: list[float]) -> list[float]:
    """rhs - M.x: positive where raising a coefficient would lower the loss."""
    return [r - sum(m * xk for m, xk in zip(row, x)) for row, r in zip(matrix, rhs)]


def _is_optimal(
    matrix: list[list[float]], rhs: list[float], x: list[float], passive: list[int], tolerance: float
) -> bool:
    """KKT for the non-negative problem, given x > 0 solves the passive set: no zero coefficient
    would lower the loss by growing."""
    gradient = _gradient(matrix, rhs, x)
    return all(gradient[j] <= tolerance for j in range(len(rhs)) if j not in passive)


def _solve_on(matrix: list[list[float]], rhs: list[float], subset: list[int]) -> list[float]:
    """Solve M.x = rhs on the rows and columns in `subset` (Cholesky), zeros elsewhere."""
    sub = [[matrix[i][j] for j in subset] for i in subset]
    size = len(subset)
    lower = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i + 1):
            rest = sub[i][j] - sum(lower[i][k] * lower[j][k] for k in range(j))
            lower[i][j] = math.sqrt(rest) if i == j else rest / lower[j][j]
    y = [0.0] * size
    for i in range(size):
        y[i] = (rhs[subset[i]] - sum(lower[i][k] * y[k] for k in range(i))) / lower[i][i]
    solution = [0.0] * size
    for i in reversed(range(size)):
        solution[i] = (y[i] - sum(lower[k][i] * solution[k] for k in range(i + 1, size))) / lower[i][i]
    x = [0.0] * len(rhs)
    for i, j in enumerate(subset):
        x[j] = solution[i]
    return x
