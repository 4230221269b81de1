"""Screenshots of the dashboard for the docs: ``python -m tools.dashboard_screenshots``.

Builds the browser tests' queue (a run in every status, tests/support/ui_flows.py),
serves it with ``ekit ui``, and saves, at 1280x800 in headless Chromium:

- ``docs/dashboard-runs.png``: the runs page;
- ``docs/dashboard-run.png``: the page of a running run (one step recorded,
  the next one running), after its live update arrived.

Needs Chromium and chromedriver (Debian: ``apt-get install chromium
chromium-driver``) and selenium (``pip install -e '.[test]'``). Not run in CI;
rerun it when the pages change, and commit the PNGs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Write the two screenshots into ``--out`` (default docs/)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from ekit_runtime.queue import SqliteQueue
    from tests.support import ui_flows
    from tests.support.browser import UiServer, chrome, wait_until

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "runs.db"
        queue = SqliteQueue(str(db))
        ids = ui_flows.populate(queue)
        with ui_flows.LiveWorker(queue), chrome(1280, 800) as driver:
            wait_until(driver, lambda d: queue.status(ids["running"]).status == "running", 20)
            ui_flows.GATE.set()
            wait_until(
                driver, lambda d: "gate" in getattr(queue.checkpoint(ids["running"]), "outputs", {}), 20
            )
            server_args = ["--queue", "runs.db", "--port", "0"]  # shown as the source
            with UiServer(server_args, cwd=Path(tmp)) as server:
                driver.get(server.url + "/")
                wait_until(driver, lambda d: d.find_elements("css selector", "#runs tr[data-run-id]"), 20)
                runs_png = args.out / "dashboard-runs.png"
                driver.save_screenshot(str(runs_png))
                driver.get(f"{server.url}/run/{urllib.parse.quote(ids['running'], safe='')}")
                wait_until(
                    driver, lambda d: d.find_elements("css selector", "#graph g.node.state-running"), 20
                )
                run_png = args.out / "dashboard-run.png"
                driver.save_screenshot(str(run_png))
    print(f"wrote {runs_png} and {run_png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
