import pytest

from kvserve.bench.serve_metrics import SLO, RequestRecord, compute_metrics


def _rec(rid: str, send: float, chunks: list[float], end: float, n: int) -> RequestRecord:
    return RequestRecord(
        rid,
        prompt_len=10,
        max_tokens=n,
        send_time=send,
        chunk_times=chunks,
        end_time=end,
        num_output_tokens=n,
        ok=True,
    )


def test_request_figures_from_known_timings() -> None:
    r = _rec("a", 1.0, [1.5, 1.6, 1.8, 2.1], 2.1, 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])


def test_single_token_has_no_tpot_and_failed_has_no_figures() -> None:
    one = _rec("a", 0.0, [0.2], 0.2, 1)
    assert one.tpot is None and one.itls == []
    failed = RequestRecord("b", 5, 5, send_time=0.0, error="HTTP 500")
    assert failed.ttft is None and failed.e2e is None and failed.tpot is None


def test_compute_metrics_throughput_latency_and_goodput() -> None:
    recs = [
        _rec("a", 0.0, [0.1, 0.2, 0.3], 0.3, 3),  # ttft 0.1, tpot 0.1
        _rec("b", 0.0, [0.4, 0.6, 0.8], 0.8, 3),  # ttft 0.4, tpot 0.2
        _rec("c", 1.0, [1.2, 1.25], 1.25, 2),  # ttft 0.2, tpot 0.05
        RequestRecord("d", 10, 3, send_time=1.0, error="HTTP 500"),
    ]
    m = compute_metrics(recs, duration_s=2.0, slo=SLO(ttft=0.25, tpot=0.15))
    assert (m["completed"], m["failed"], m["num_requests"]) == (3, 1, 4)
    assert m["num_output_tokens"] == 8 and m["num_prompt_tokens"] == 30
    assert m["requests_per_s"] == pytest.approx(1.5)
    assert m["output_tokens_per_s"] == pytest.approx(4.0)
    assert m["total_tokens_per_s"] == pytest.approx(19.0)
    assert m["ttft"]["mean"] == pytest.approx((0.1 + 0.4 + 0.2) / 3)
    assert m["ttft"]["median"] == pytest.approx(0.2)
    assert m["tpot"]["max"] == pytest.approx(0.2)
    assert m["itl"]["count"] == 5
    assert m["e2e"]["max"] == pytest.approx(0.8)
    # a and c meet both SLOs; b misses both; d failed.
    assert m["num_good_requests"] == 2
    assert m["goodput_requests_per_s"] == pytest.approx(1.0)
    assert m["slo_attainment"] == pytest.approx(0.5)
    assert m["errors"] == ["HTTP 500"]


def test_goodput_without_slo_counts_every_completed_request() -> None:
    recs = [_rec("a", 0.0, [5.0, 9.0], 9.0, 2)]
    m = compute_metrics(recs, duration_s=9.0)
    assert m["num_good_requests"] == 1
    only_tpot = compute_metrics(recs, duration_s=9.0, slo=SLO(tpot=3.0))
    assert only_tpot["num_good_requests"] == 0


def test_compute_metrics_rejects_bad_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], 0.0)


def test_latency_samples_keep_every_completed_request_sorted() -> None:
    from kvserve.bench.serve_metrics import latency_samples

    recs = [
        _rec("a", 0.0, [0.4, 0.6, 0.8], 0.8, 3),
        _rec("b", 0.0, [0.1, 0.2, 0.3], 0.3, 3),
        _rec("c", 1.0, [1.2], 1.2, 1),  # one token: no TPOT, no ITL
        RequestRecord("d", 10, 3, send_time=1.0, error="HTTP 500"),
    ]
    s = latency_samples(recs)
    assert s["ttft"] == pytest.approx([0.1, 0.2, 0.4])
    assert s["tpot"] == pytest.approx([0.1, 0.2])
    assert s["itl"] == pytest.approx([0.1, 0.1, 0.2, 0.2])
    assert s["e2e"] == pytest.approx([0.2, 0.3, 0.8])


def test_itl_slo_holds_on_each_requests_p99_gap() -> None:
    steady = [0.1 * i for i in range(1, 102)]  # 100 gaps of 0.1 s
    one_stall = [*steady[:-1], steady[-1] + 0.8]  # 99 gaps of 0.1 s, one of 0.9 s
    two_stalls = [*one_stall[:-2], one_stall[-2] + 0.8, one_stall[-1] + 0.8]
    recs = [
        _rec(rid, 0.0, c, c[-1], len(c))
        for rid, c in zip("abc", (steady, one_stall, two_stalls), strict=True)
    ]
    m = compute_metrics(recs, duration_s=12.0, slo=SLO(itl=0.15))
    # p99 of 100 gaps interpolates between the two largest: one stall passes (0.108 s),
    # two do not (0.9 s).
    assert m["num_good_requests"] == 2
    assert m["slo_itl_s"] == 0.15
    short = _rec("d", 0.0, [0.1, 0.2, 0.9, 1.0], 1.0, 4)  # gaps 0.1, 0.7, 0.1: p99 0.688
    assert compute_metrics([short], 1.0, SLO(itl=0.68))["num_good_requests"] == 0
    assert compute_metrics([short], 1.0, SLO(itl=0.69))["num_good_requests"] == 1
