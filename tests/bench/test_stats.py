import math

import numpy as np
import pytest

from kvserve.bench.stats import percentile, summarize


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_single_value_and_errors() -> None:
    assert percentile([2.5], 99) == 2.5
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_summarize_known_values_and_empty() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["median"] == 2.5 and s["max"] == 4.0 and s["count"] == 4
    assert s["p90"] == pytest.approx(3.7)
    empty = summarize([])
    assert empty["count"] == 0 and math.isnan(empty["mean"]) and math.isnan(empty["p99"])


def test_call_in_worker_thread_returns_and_reraises() -> None:
    import threading

    from kvserve.bench.offline import call_in_worker_thread

    assert call_in_worker_thread(lambda: threading.current_thread().name) == "kvserve-bench-step"

    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        call_in_worker_thread(boom)
