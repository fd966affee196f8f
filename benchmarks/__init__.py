"""The syncless benchmark suite: where a training loop's time goes, and what syncless wins back.

    python -m benchmarks.run            # full suite (a few minutes on one GPU)
    python -m benchmarks.run --quick    # smoke test (< 60 s)

Every number is a ratio or a median measured within one run: variants are interleaved in rounds,
and the spread across rounds is reported next to each median.
"""
