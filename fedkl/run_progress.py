"""What ``fedkl run`` shows around a run: a progress bar with ETA while it trains (only when stderr
is a terminal; plain round lines otherwise), and, on Ctrl-C, one line saying what was charged, how
many releases were made and whether a model was released (read back from the ledger)."""

from __future__ import annotations

from fedkl.privacy import LedgerError, PrivacyLedger
from fedkl.runner import RunObserver


class CliObserver(RunObserver):
    """Follows one run (:data:`fedkl.runner.RUN_OBSERVER`). ``console``: a rich Console to draw the
    progress bar on (None: no bar)."""

    def __init__(self, console=None) -> None:
        self.console = console
        self.run_id: str | None = None
        self.ledger_path: str | None = None
        self.released: bool | None = None  # None until the algorithm returned
        self._bar = None
        self._task = None

    def started(self, run_id: str, ledger_path: str) -> None:
        self.run_id, self.ledger_path = run_id, ledger_path

    def round(self, record: dict) -> None:
        if self.console is None:
            return
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rounds, ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("training", total=int(record["rounds"]))
        self._bar.update(self._task, total=int(record["rounds"]), completed=int(record["round"]))

    def trained(self, released: bool) -> None:
        self.released = released
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def interrupted_line(self) -> str:
        """One line: what the interrupted run charged and released (from its ledger)."""
        if self.run_id is None:
            return "fedkl run: interrupted before the run started: nothing was charged or released"
        try:
            with PrivacyLedger(self.ledger_path) as ledger:
                got = ledger.run_charges(self.run_id)
                status = next((r["status"] for r in ledger.runs() if r["run_id"] == self.run_id), "unknown")
        except LedgerError as e:
            return f"fedkl run: interrupted: run {self.run_id}; its ledger cannot be read back ({e})"
        charged = (
            f"{got['releases']} release(s) charged to ledger {self.ledger_path} (most charged user: "
            f"eps = {got['max_user_epsilon']:.4g}, rho = {got['max_user_rho']:.4g})"
            if got["releases"]
            else f"nothing charged to ledger {self.ledger_path}"
        )
        model = (
            "the model was released (training had finished; result.json may lack the later evaluations)"
            if self.released
            else "no model was released"
        )
        return f"fedkl run: interrupted: run {self.run_id} made {charged}; {model}; the ledger marks the run {status}"


def make_observer(stderr) -> CliObserver:
    """A bar on ``stderr`` when it is a terminal and rich is installed, plain lines otherwise."""
    if not (hasattr(stderr, "isatty") and stderr.isatty()):
        return CliObserver()
    try:
        from rich.console import Console
    except ImportError:
        return CliObserver()
    return CliObserver(Console(file=stderr))
