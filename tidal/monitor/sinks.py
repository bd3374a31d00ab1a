"""Metric sinks: where each step's metrics go (`run.loggers`).

`metrics.jsonl` in the run directory is always written: it is the run's record, which resume,
`tidal eval` and the docs' metric catalog read. Beside it, any of: `console` (a line per
step), `tensorboard` (event files, through TensorBoard's writer as PyTorch ships it), `wandb`
(Weights & Biases' own client; offline unless the machine is logged in) and `mlflow`
(MLflow's tracking client; MLflow's default store unless `run.mlflow_tracking_uri`).
Every sink gets the same names and values as `metrics.jsonl`: numbers only, a non-finite
value left out of the step (JSONL writes it as null). Tables of sampled episodes
(`run.log_samples`) go to the console and to every sink that has tables.

A sink that fails while the run goes on (a W&B outage) is named in a warning with its error,
once, and the run continues without it; the JSONL record is never given up. A disk error
(a full disk under the event files: tidal/durable.py) is not a sink's failure but the run's:
it stops the run as any write of its directory does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tidal.durable import append_lines, disk_error, named, write_atomic

log = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
CONSOLE_KEYS = (("reward", "reward", "{:.3f}"), ("accuracy", "acc", "{:.3f}"), ("eval/accuracy", "eval", "{:.3f}"),
                ("kl", "kl", "{:.4f}"), ("entropy", "entropy", "{:.3f}"), ("episodes/failed_frac", "failed", "{:.2f}"),
                ("tokens_per_s", "tok/s", "{:.0f}"), ("time/step_s", "s/step", "{:.2f}"))


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The values every sink logs: finite numbers (bools as 0/1)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(v)):
            out[k] = float(v)
    return out


class Sink(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step in `metrics.jsonl`, each line whole or not at all (a full disk
    leaves no torn line: tidal/durable.py), on disk before the step goes on."""

    name = "jsonl"

    def __init__(self, path: Path, truncate_after: int | None = None):
        self.path = path
        if truncate_after is not None and path.exists():
            # On resume, drop records past the checkpoint so the file reads as one run, and any
            # line that does not read (a torn one, from a process that died writing it).
            keep, torn = [], []
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                try:
                    record = json.loads(line) if line else None
                except ValueError:
                    torn.append(i)
                    continue
                if isinstance(record, dict) and record.get("step", math.inf) <= truncate_after:
                    keep.append(line)
            if torn:
                log.warning("%s: line(s) %s did not read as JSON (a write the process did not finish) and were "
                            "removed", path, ", ".join(map(str, torn[:10])))
            write_atomic(path, "".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        append_lines(self.path, [json.dumps({"step": step, **clean}) + "\n"])

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        pass  # the episodes themselves are in the Parquet store

    def close(self) -> None:
        pass  # each line was written whole when it was logged


class ConsoleSink:
    """A line per step on stderr (above the progress bar), also written to the run's train.log."""

    name = "console"

    def __init__(self, total_steps: int, file_log: logging.Logger):
        self.total = total_steps
        self.file_log = file_log  # the run log only (does not propagate to the console)

    def _write(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)
        self.file_log.info("%s", text)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in CONSOLE_KEYS if key in metrics]
        self._write(f"step {step}/{self.total}  " + "  ".join(parts))

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        lines = [f"samples of step {step}:"]
        for row in rows:
            cells = dict(zip(columns, row))
            text = " | ".join(f"{c}: {_one_line(cells[c], 160)}" for c in columns if c != "step" and cells[c] != "")
            lines.append("  " + text)
        self._write("\n".join(lines))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files under `directory` (TensorBoard's own event format, through PyTorch's
    SummaryWriter, which needs the `tensorboard` package). On resume, `purge_step` hides what an
    earlier start logged past the checkpoint."""

    name = "tensorboard"

    def __init__(self, directory: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self.writer = SummaryWriter(str(directory), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = time.time()
        with self._files_named():
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step, walltime=now)
            self.writer.flush()

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "".join("| " + " | ".join(_one_line(c, 400).replace("|", "\\|") for c in row) + " |\n" for row in rows)
        with self._files_named():
            self.writer.add_text("samples", head + body, step)
            self.writer.flush()

    @contextlib.contextmanager
    def _files_named(self):
        # TensorBoard writes from a thread of its own and hands that thread's error to the next
        # add or flush, without a file name: a full disk is then named as the event files' directory.
        try:
            yield
        except OSError as e:
            raise named(e, self.directory) from e

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run through `wandb`'s own client. Mode `auto`: online when the machine
    is logged in (WANDB_API_KEY, or `wandb login`'s netrc entry), else offline, said once; a
    WANDB_MODE in the environment is W&B's own setting and wins. Files under RUN/wandb."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: dict, mode: str, project: str,
                 entity: str | None, run_id: str | None):
        import wandb

        if mode == "auto" and not os.environ.get("WANDB_MODE"):
            mode = "online" if _wandb_logged_in() else "offline"
            if mode == "offline":
                log.warning("run.loggers: wandb is offline (this machine is not logged in to W&B); the run is in %s "
                            "and `wandb sync` uploads it later", run_dir / "wandb")
        self.run = wandb.init(project=project, entity=entity, name=run_name, dir=str(run_dir), config=config,
                              mode=None if mode == "auto" else mode, id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", quiet=True))
        self.run_id = self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MlflowSink:
    """An MLflow run through MLflow's tracking client, in `tracking_uri` (None: MLflow's own
    default, MLFLOW_TRACKING_URI or ./mlflow.db). Metrics go in one batch per step; the config
    is the run's `config.json` artifact; tables are JSON artifacts under `samples/`."""

    name = "mlflow"

    def __init__(self, tracking_uri: str | None, experiment: str, run_name: str, config: dict, run_id: str | None,
                 run_dir: Path):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"tidal.run_dir": str(run_dir.resolve())})
            run_id = run.info.run_id
            self.client.log_dict(run_id, config, "config.json")
        self.run_id = run_id
        self.uri = self.client.tracking_uri

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Sinks:
    """Every sink of the run, fed together. A sink other than JSONL that raises is named once
    and dropped; the run goes on."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = numeric(metrics)
        for sink in list(self.sinks):
            self._call(sink, "log", step, metrics if sink.name == "jsonl" else values)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        for sink in list(self.sinks):
            self._call(sink, "table", step, columns, rows)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - one sink failing to close must not hide the others' ends
                log.warning("run.loggers: closing %s raised %s: %s", sink.name, type(e).__name__, e)
        self.sinks = []

    def _call(self, sink: Sink, what: str, *args: Any) -> None:
        if sink.name == "jsonl":
            getattr(sink, what)(*args)  # the run's record: a failure here stops the run
            return
        try:
            getattr(sink, what)(*args)
        except Exception as e:  # a metrics service must not stop training
            if disk_error(e) is not None:
                raise  # a full disk: every write of the run fails next; stop it now, naming this one
            log.warning("run.loggers: %s failed at step %d (%s: %s); the run continues without it, metrics.jsonl "
                        "has every step", sink.name, args[0], type(e).__name__, e, exc_info=True)
            self.sinks.remove(sink)
            try:
                sink.close()
            except Exception:  # noqa: BLE001, S110 - already reported above
                pass


def open_sinks(cfg: Any, run_dir: Path, resume_step: int | None, config: dict, file_log: logging.Logger) -> Sinks:
    """The sinks of `cfg.run.loggers` for the run in `run_dir` (their client libraries were
    checked when the config loaded). The W&B and MLflow run ids are kept in RUN/sinks.json, so a
    resumed run continues the same runs there."""
    run = cfg.run
    ids_path = run_dir / "sinks.json"
    ids = json.loads(ids_path.read_text()) if resume_step is not None and ids_path.is_file() else {}
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", truncate_after=resume_step)]
    try:
        for name in dict.fromkeys(run.loggers):
            if name == "console":
                sinks.append(ConsoleSink(cfg.train.steps, file_log))
            elif name == "tensorboard":
                sinks.append(TensorBoardSink(Path(run.tensorboard_dir) if run.tensorboard_dir else run_dir / "tensorboard",
                                             purge_step=None if resume_step is None else resume_step + 1))
            elif name == "wandb":
                sink = WandbSink(run_dir, run_dir.name, config, run.wandb_mode, run.wandb_project, run.wandb_entity,
                                 ids.get("wandb"))
                ids["wandb"] = sink.run_id
                sinks.append(sink)
            elif name == "mlflow":
                sink = MlflowSink(run.mlflow_tracking_uri, run.mlflow_experiment, run_dir.name, config,
                                  ids.get("mlflow"), run_dir)
                ids["mlflow"] = sink.run_id
                log.info("run.loggers: MLflow run %s in %s", sink.run_id, sink.uri)
                sinks.append(sink)
    except BaseException:
        Sinks(sinks).close()
        raise
    if ids:
        write_atomic(ids_path, json.dumps(ids) + "\n")
    return Sinks(sinks)


def _one_line(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else (f"{value:.3f}" if isinstance(value, float) else str(value))
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"
