"""Running many cases in one process group: each case's failure is reported by its own test while
the others still run."""
import time
import traceback


def run_each(fn, cases) -> list:
    """``fn(*case)`` for each case: its result dict, or ``{"error": traceback}``, with the
    seconds it took."""
    out = []
    for case in cases:
        start = time.perf_counter()
        try:
            out.append(fn(*case))
        except Exception:  # noqa: BLE001 - reported by the case's test; the others still run
            out.append({"error": traceback.format_exc()})
        out[-1]["seconds"] = time.perf_counter() - start
    return out
