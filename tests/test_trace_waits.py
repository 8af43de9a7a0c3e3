"""scripts/trace_waits.py on a hand-made trace whose idle time and sync sites are known."""

from tests.conftest import REPO_ROOT, load_module_by_path

trace_waits = load_module_by_path(REPO_ROOT / "scripts" / "trace_waits.py", "dsv4_trace_waits")


def frame(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_idle_gaps_and_syncs_are_attributed_to_the_innermost_frame_of_our_code():
    events = [
        frame("vllm_dsv4/model/attention.py(90): forward", 0, 5000),
        frame("vllm_dsv4/attention/flashmla.py(200): _spans", 1200, 600),
        frame("torch/_tensor.py(1): item", 1400, 200),  # not ours: the frame above it is named
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1500, "dur": 80, "tid": 1, "args": {}},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 4500, "dur": 20, "tid": 1, "args": {}},
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 2500, "dur": 5, "tid": 1,  # as Triton launches
         "args": {"correlation": 7}},
        {"cat": "kernel", "name": "first", "ts": 0, "dur": 1000, "tid": 9, "args": {"correlation": 6}},
        {"cat": "kernel", "name": "overlapping", "ts": 500, "dur": 700, "tid": 9, "args": {}},
        {"cat": "kernel", "name": "after_the_gap", "ts": 3000, "dur": 1000, "tid": 9, "args": {"correlation": 7}},
    ]
    busy, span, gaps = trace_waits.gpu_idle(events)
    assert (busy, span) == (2200, 4000)
    assert [(g, e["name"]) for g, e in gaps] == [(1800, "after_the_gap")]
    text = trace_waits.report(events)
    assert "2.2 ms busy over 4.0 ms, 1.8 ms idle in 1 gaps" in text
    assert "1.800 ms before after_the_gap  <- vllm_dsv4/model/attention.py(90): forward" in text
    assert "1 x cudaStreamSynchronize" in text and "0.080 ms  vllm_dsv4/attention/flashmla.py(200): _spans" in text
    assert "0.020 ms  vllm_dsv4/model/attention.py(90): forward" in text


def test_host_frames_total_counts_nesting_once_and_own_time_leaves_out_children():
    events = [
        frame("vllm/v1/engine/core.py(1): step", 0, 1000),
        frame("vllm/v1/worker/gpu_model_runner.py(2): execute_model", 100, 600),
        frame("vllm_dsv4/kv/spec.py(3): build", 150, 200),
        frame("vllm_dsv4/kv/spec.py(3): build", 400, 100),
        frame("vllm/v1/engine/core.py(1): step", 2000, 500, tid=2),  # another thread's step
        frame("recurse", 3000, 100),
        frame("recurse", 3010, 50),
    ]
    rows = {name: (calls, total, own) for name, calls, total, own in trace_waits.host_frames(events)}
    assert rows["vllm/v1/engine/core.py(1): step"] == (2, 1500, 900)
    assert rows["vllm/v1/worker/gpu_model_runner.py(2): execute_model"] == (1, 600, 300)
    assert rows["vllm_dsv4/kv/spec.py(3): build"] == (2, 300, 300)
    assert rows["recurse"] == (2, 100, 100)
    assert [r[0] for r in trace_waits.host_frames(events)][0] == "vllm/v1/engine/core.py(1): step"
    text = trace_waits.report(events, num_frames=2)
    assert "     1.500     0.900      2  vllm/v1/engine/core.py(1): step" in text
