"""scripts/memory_peak.py: the replay of allocator events finds the peak and what is live then."""

from _script_loader import load_script


def _ev(action, addr, size, where="lightning_lorafusion/kernels/x.py", line=1):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/usr/lib/torch/foo.py", "line": 9, "name": "inner"},
                       {"filename": f"/repo/{where}", "line": line, "name": "fn"}]}


def test_live_at_peak_groups_blocks_by_our_frame():
    mp = load_script("memory_peak")
    events = [
        _ev("alloc", 1, 100, line=10),
        _ev("alloc", 2, 50, line=20),
        _ev("free_completed", 2, 50, line=20),
        _ev("alloc", 3, 70, line=30),
        _ev("alloc", 4, 30, line=10),           # 200 live
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},  # ignored: not yet free
        _ev("free_completed", 1, 100, line=10),
        _ev("free_completed", 3, 70, line=30),
        _ev("alloc", 5, 190, where="scripts/bench.py", line=5),   # 30 + 190 = 220 > 200: the new peak
    ]
    peak, by_frame, at = mp.live_at_peak(events)
    assert (peak, at) == (220, 8)
    assert by_frame == {"x.py:10 fn": 30, "bench.py:5 fn": 190}
    peak, by_frame, at = mp.live_at_peak(events[:8])
    assert (peak, at) == (200, 4)
    assert by_frame == {"x.py:10 fn": 130, "x.py:30 fn": 70}


def test_live_at_peak_counts_frees_of_older_blocks_against_the_start():
    mp = load_script("memory_peak")
    events = [_ev("free_completed", 99, 40), _ev("alloc", 1, 30, line=3), _ev("alloc", 2, 20, line=4)]
    peak, by_frame, at = mp.live_at_peak(events)
    assert (peak, at) == (10, 2)  # 50 allocated after 40 of the older bytes were freed
    assert by_frame == {"x.py:3 fn": 30, "x.py:4 fn": 20, "(freed: allocated before the history)": -40}


def test_frame_label_falls_back_to_the_innermost_frame():
    mp = load_script("memory_peak")
    assert mp.frame_label([{"filename": "/a/torch/nn/f.py", "line": 3, "name": "g"}]) == "f.py:3 g"
    assert mp.frame_label([]) == "?"


def test_live_at_peak_by_size_label():
    mp = load_script("memory_peak")
    events = [_ev("alloc", 1, 2**20), _ev("alloc", 2, 2**20, line=7), _ev("alloc", 3, 2**21)]
    _, by_size, _ = mp.live_at_peak(events, lambda e: mp.size_label(e["size"]))
    assert by_size == {"blocks of 1.00 MiB": 2 * 2**20, "blocks of 2.00 MiB": 2**21}
