"""`mpdl launch`'s supervisor: run `mpdl train` under the MPI launcher, restart it when it fails.

The launcher is `srun` inside a Slurm allocation (SLURM_JOB_ID set and srun on PATH), otherwise
the `mpiexec` beside the Python executable (a virtual environment's MPICH wheel), otherwise the
first `mpiexec` or `mpirun` on PATH. The environment is passed through (Hydra and Slurm pass it
all; Open MPI gets -x for the variables Python needs).

When a run fails, the supervisor says which rank failed and how, from what the launcher printed:
Hydra's "BAD TERMINATION" block gives the PID, the exit code and the signal of the first process
that ended, and the supervisor maps the PID to its rank through the PMI_RANK /
OMPI_COMM_WORLD_RANK / SLURM_PROCID of the processes it saw running (on this host, through /proc);
MPI_Abort's "rank R in comm 0" line, mpdl's own "rank R failed" line, Open MPI's "process rank R
with PID ... exited on signal S" and srun's "task R: Killed" name the rank themselves. It then
restarts with --resume from the newest whole checkpoint, up to `max_restarts` times. A rank may die
before the launcher can end the others (in their start-up, MPICH's launcher waits on them for
ever): when the launcher has not ended the job `GRACE_S` seconds after a rank ended badly (its
watcher's line, its status file, or, on this host, its processes gone without a status), the
supervisor stops the launcher and every process under it. With a
hostfile, it first asks every host to start one process; hosts that fail are left out, and the job
goes on with fewer ranks (the slots of the hosts that answered, at least `min_ranks`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mpdl.training import checkpoint
from mpdl.training.checkpoint import CheckpointWriteError
from mpdl.training.guard import NonFiniteStop

#: variables in which launchers give a process its rank
RANK_VARIABLES = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"SLURM_PROCID")
#: every rank runs `mpdl` under a watcher that reports how it ended
WATCHER = (sys.executable, "-m", "mpdl.tools.rankwatch")
PROGRAM = (sys.executable, "-m", "mpdl.cli")
#: what a watcher prints when its rank ended badly
WATCHER_LINE = re.compile(r"mpdl launch: rank (\d+) \(pid \d+ on \S+\) (?:was killed by signal "
                          r"(\d+)|exited with status (\d+))")
#: seconds the launcher has to end the job after a rank ended badly before the supervisor does
GRACE_S = 10.0
#: seconds between the supervisor's looks at the job
POLL_S = 0.5
#: mpdl's exit status for bad flags or an inconsistent configuration (not worth a restart)
USAGE_STATUS = 2
#: `mpdl train`'s exit statuses that a restart would only repeat, and why
FINAL_STATUSES = {
    USAGE_STATUS: "train refused its arguments (the same on every rank)",
    NonFiniteStop.exit_status: "the run stopped on a NaN or inf loss or weight (it would diverge "
                               "again from the same checkpoint)",
    CheckpointWriteError.exit_status: "a checkpoint could not be written (a full disk or a "
                                      "read-only path stays so)",
}
#: what Open MPI needs to be told to pass on
OPENMPI_FORWARD = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")


class LaunchError(ValueError):
    """No launcher, or arguments the supervisor cannot work with."""


@dataclass
class Launcher:
    """An MPI launcher: its command, and its kind (hydra, openmpi, slurm or other)."""

    path: str
    kind: str

    def command(self, ranks: int, hostfile: str | None, program: Sequence[str]) -> list[str]:
        if self.kind == "slurm":
            return [self.path, "-n", str(ranks), *program]
        cmd = [self.path, "-n", str(ranks)]
        if hostfile:
            cmd += ["-hostfile", hostfile]
        if self.kind == "openmpi":
            cmd += [a for v in OPENMPI_FORWARD if v in os.environ for a in ("-x", v)]
        return [*cmd, *program]

    def probe(self, host: str) -> list[str]:
        """A command that starts one process on host."""
        flag = "--host" if self.kind == "openmpi" else "-hosts"
        return [self.path, "-n", "1", flag, host, sys.executable, "-c", "pass"]


def find_launcher(env: dict[str, str] | None = None) -> Launcher:
    """srun in a Slurm allocation, else mpiexec beside Python, else mpiexec/mpirun on PATH."""
    env = dict(os.environ) if env is None else env
    srun = shutil.which("srun", path=env.get("PATH"))
    if env.get("SLURM_JOB_ID") and srun:
        return Launcher(srun, "slurm")
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else (shutil.which("mpiexec", path=env.get("PATH"))
                                                  or shutil.which("mpirun", path=env.get("PATH")))
    if not found:
        raise LaunchError("no MPI launcher: no mpiexec beside " + sys.executable + " nor on "
                          "PATH, and no Slurm allocation (install MPI: pip install "
                          "\"mpdl[mpich]\")")
    return Launcher(found, _kind(found))


def _kind(path: str) -> str:
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "other"
    return "hydra" if "HYDRA" in text else "openmpi" if "Open MPI" in text or "OpenRTE" in text \
        else "other"


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """(host, slots) per line of a Hydra ("host:4") or Open MPI ("host slots=4") hostfile."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([^\s:]+)(?::(\d+))?(?:\s+slots\s*=\s*(\d+))?", line)
        if not m:
            raise LaunchError(f"--hostfile {path}: cannot read the line {line!r}")
        hosts.append((m.group(1), int(m.group(2) or m.group(3) or 1)))
    if not hosts:
        raise LaunchError(f"--hostfile {path}: no hosts")
    return hosts


@dataclass
class Failure:
    """How a run ended: the failing rank (None when the launcher does not say), its exit status
    or signal, and how that was found."""

    returncode: int
    rank: int | None = None
    status: int | None = None
    signal: int | None = None
    how: str = ""
    #: the rank a timed-out rank waited for (the one that stalled or missed a collective)
    stalled: int | None = None

    def describe(self) -> str:
        if self.stalled is not None and self.stalled != self.rank:
            return (f"rank {self.stalled} stalled or missed a collective: rank {self.rank} timed "
                    f"out waiting for it" + (f" [{self.how}]" if self.how else ""))
        who = f"rank {self.rank}" if self.rank is not None else "a rank (the launcher did not say " \
            "which)"
        if self.signal is not None:
            what = f"was killed by signal {self.signal} ({_signal_name(self.signal)})"
        elif self.status is not None:
            what = f"exited with status {self.status}"
        else:
            what = f"failed (the launcher exited with status {self.returncode})"
        return f"{who} {what}" + (f" [{self.how}]" if self.how else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def parse_failure(output: str, returncode: int, ranks_by_pid: dict[int, int],
                  vanished: int | None = None) -> Failure:
    """What the output says about the failure. First the watcher's line (mpdl.tools.rankwatch:
    the first rank whose program ended badly, and how), then `vanished` (a rank whose watcher
    the supervisor saw end on this host without a status: killed itself), then the launcher's
    own reports: Hydra names one PID, not always the first to end (it may be one it killed itself
    while cleaning up), mapped to its rank through `ranks_by_pid`."""
    failure = Failure(returncode)
    found = []
    if vanished is not None and not WATCHER_LINE.search(output):
        failure.rank = vanished
        found.append(f"the supervisor: rank {vanished}'s watcher ended without a status (killed)")
    m = WATCHER_LINE.search(output)
    if m:
        failure.rank = int(m.group(1))
        if m.group(2):
            failure.signal = int(m.group(2))
        else:
            failure.status = int(m.group(3))
        found.append("the rank's watcher: " + m.group(0).split(": ", 1)[1])
    m = re.search(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*=\s*PID (\d+) "
                  r"RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)", output)
    if m:
        pid, code = int(m.group(1)), int(m.group(3))
        s = re.search(r"EXIT STRING: .*\(signal (\d+)\)", output)
        reported = ranks_by_pid.get(pid)
        if failure.rank is None or failure.rank == reported:
            failure.rank = reported
            if s:
                failure.signal = int(s.group(1))
            else:
                failure.status = code
        found.append(f"mpiexec's BAD TERMINATION report: PID {pid} on {m.group(2)}"
                     + (f" (rank {reported})" if reported is not None else "")
                     + f", exit code {code}" + (f", {s.group(0).split(': ', 1)[1]}" if s else ""))
    m = re.search(r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)", output)
    if m:
        failure.rank, failure.signal = int(m.group(1)), int(m.group(4))
        found.append("mpirun's report: " + m.group(0))
    m = re.search(r"process rank (\d+) with PID (\d+) on node (\S+) exited with (?:non-zero )?"
                  r"(?:exit )?(?:status|code) (\d+)", output)
    if m and failure.rank is None:
        failure.rank, failure.status = int(m.group(1)), int(m.group(4))
        found.append("mpirun's report: " + m.group(0))
    m = re.search(r"srun: error: (\S+): tasks? (\d+)[^:]*: (Killed|Exited with exit code (\d+))",
                  output)
    if m:
        failure.rank = int(m.group(2))
        if m.group(4):
            failure.status = int(m.group(4))
        else:
            failure.signal = signal.SIGKILL
        found.append("srun's report: " + m.group(0))
    for pattern, what in ((r"mpdl: rank (\d+) failed", "mpdl's report"),
                          (r"Abort\(\d+\) on node \d+ \(rank (\d+) in comm 0\)", "MPI_Abort")):
        m = re.search(pattern, output)
        if m and failure.rank is None:
            failure.rank = int(m.group(1))
            found.append(f"{what}: {m.group(0)}")
    m = re.search(r"ssh: Could not resolve hostname ([^:\s]+)|ssh: connect to host (\S+)", output)
    if m or "Launch proxy failed" in output:
        host = (m.group(1) or m.group(2)) if m else None
        found.append("mpiexec could not start its proxy" + (f" on host {host}" if host else "")
                     + (f" ({m.group(0)})" if m else ""))
    m = re.search(r"CollectiveTimeout: \S+ rank (\d+) waited more than \S+ s (?:receiving from "
                  r"|sending to |in .{0,80}? for )rank (\d+)", output)
    if m:
        failure.rank, failure.stalled = int(m.group(1)), int(m.group(2))
        found.append("the timeout: " + m.group(0).split(": ", 1)[1])
    failure.how = "; ".join(found)
    return failure


def _descendants(root: int) -> list[int]:
    """The pids of root's descendants (Linux /proc; [] elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            found.append(pid)
    return found


def _ranks_of_children(root: int) -> dict[int, int]:
    """{pid: rank} of root's descendants that a launcher gave a rank (Linux /proc; {} elsewhere)."""
    ranks = {}
    for pid in _descendants(root):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            name, _, value = item.partition(b"=")
            if name in RANK_VARIABLES and value.isdigit():
                ranks[pid] = int(value)
                break
    return ranks


def _pump(source: IO[str], sink: IO[str], tail: deque, failed: list[int]) -> None:
    for line in source:
        sink.write(line)
        sink.flush()
        tail.append(line)
        m = WATCHER_LINE.search(line)
        if m:
            failed.append(int(m.group(1)))


@dataclass
class Run:
    """What one run of the job left: its exit status, the tail of its output, {pid: rank} of the
    rank processes seen on this host, and the rank whose watcher ended without a status."""

    returncode: int
    output: str
    ranks_by_pid: dict[int, int]
    vanished: int | None = None


def _statuses(folder: str) -> dict[int, int]:
    """{rank: exit status} of the watchers on this host that have written theirs to folder."""
    found = {}
    for path in Path(folder).glob("rank-*"):
        with contextlib.suppress(OSError, ValueError):
            found[int(path.name[5:])] = int(path.read_text())
    return found


def _stop(job: subprocess.Popen) -> None:
    """End the launcher and every process under it on this host: SIGTERM (the launcher passes it
    on), then SIGKILL to what is left."""
    tree = _descendants(job.pid)
    job.terminate()
    try:
        job.wait(5)
    except subprocess.TimeoutExpired:
        job.kill()
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    job.wait()


def run_once(cmd: list[str], say: Callable[[str], None], status_folder: str,
             grace: float = GRACE_S) -> Run:
    """Run cmd, passing its output through (and keeping its tail); stop it when a rank ended
    badly (a watcher's line or status in status_folder, or a rank's processes gone without a
    status) and the launcher has not ended the job `grace` seconds later."""
    tail: deque = deque(maxlen=400)
    failed: list[int] = []
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           bufsize=1, errors="replace")
    pumps = [threading.Thread(target=_pump, args=(job.stdout, sys.stdout, tail, failed),
                              daemon=True),
             threading.Thread(target=_pump, args=(job.stderr, sys.stderr, tail, failed),
                              daemon=True)]
    for p in pumps:
        p.start()
    ranks: dict[int, int] = {}
    gone: dict[int, float] = {}  # rank -> when its processes were first seen gone
    vanished, noticed = None, None
    try:
        while job.poll() is None:
            now = time.monotonic()
            alive = _ranks_of_children(job.pid)
            ranks.update(alive)
            for rank in set(ranks.values()) - set(alive.values()):
                gone.setdefault(rank, now)
            statuses = _statuses(status_folder)
            unreported = [r for r, since in gone.items()
                          if r not in statuses and now - since > 2 * POLL_S]
            if noticed is None:
                bad = [r for r, code in statuses.items() if code] + failed + unreported
                if bad:
                    noticed = now
                    if not failed and not any(statuses.get(r) for r in bad):
                        vanished = bad[0]
            if noticed is not None and now - noticed > grace and job.poll() is None:
                say(f"a rank ended {grace:g} s ago and the launcher has not ended the others: "
                    f"stopping the job")
                _stop(job)
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        say("interrupted: stopping the job")
        job.send_signal(signal.SIGINT)
        job.wait()
        raise
    for p in pumps:
        p.join(5)
    return Run(job.returncode, "".join(tail), ranks, vanished)


@dataclass
class LaunchPlan:
    """What `supervise` runs: ranks, hostfile, restarts, the train arguments."""

    ranks: int
    train_args: list[str]
    hostfile: str | None = None
    max_restarts: int = 0
    min_ranks: int | None = None


def flag_value(train_args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` among train's arguments (FLAG VALUE or FLAG=VALUE), None if absent."""
    for i, arg in enumerate(train_args):
        if arg == flag and i + 1 < len(train_args):
            return train_args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def checkpoint_dir(train_args: Sequence[str]) -> str | None:
    """The --checkpoint DIR among train's arguments, else the checkpoint.dir of their --config
    file (None when the file cannot be read: train itself reports that)."""
    directory, config = flag_value(train_args, "--checkpoint"), flag_value(train_args, "--config")
    if directory is not None or config is None:
        return directory
    from mpdl.training.config_file import read_config_file  # noqa: PLC0415

    try:
        return read_config_file(config).get("checkpoint.dir")
    except ValueError:
        return None


def check(plan: LaunchPlan) -> None:
    """LaunchError naming the flag for a plan that cannot run."""
    if plan.ranks < 1:
        raise LaunchError(f"-n: expected a positive number of ranks, got {plan.ranks}")
    if plan.max_restarts < 0:
        raise LaunchError(f"--max-restarts: expected a number >= 0, got {plan.max_restarts}")
    if plan.min_ranks is not None and not 1 <= plan.min_ranks <= plan.ranks:
        raise LaunchError(f"--min-ranks: expected a number of ranks in [1, {plan.ranks}] (-n), "
                          f"got {plan.min_ranks}")
    if plan.min_ranks is not None and plan.min_ranks < plan.ranks and not plan.hostfile:
        raise LaunchError("--min-ranks below -n needs --hostfile (ranks are dropped with the "
                          "hosts that stop answering)")
    if not plan.train_args or plan.train_args[0] != "train":
        raise LaunchError("expected the command after --: train ARGS... (mpdl launch -n 4 -- "
                          "train --checkpoint DIR ...)")
    if plan.max_restarts and not checkpoint_dir(plan.train_args):
        raise LaunchError("--max-restarts: the train arguments need --checkpoint DIR (a restart "
                          "resumes from it)")
    if plan.hostfile:
        read_hostfile(plan.hostfile)


def live_hosts(launcher: Launcher, hosts: list[tuple[str, int]],
               say: Callable[[str], None], timeout: float = 60) -> list[tuple[str, int]]:
    """The hosts on which the launcher can start a process."""
    alive = []
    for host, slots in hosts:
        try:
            ok = subprocess.run(launcher.probe(host), capture_output=True,
                                timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            alive.append((host, slots))
        else:
            say(f"host {host} does not answer (one process could not be started there within "
                f"{timeout:g} s); leaving out its {slots} slot(s)")
    return alive


def supervise(plan: LaunchPlan, launcher: Launcher | None = None,
              say: Callable[[str], None] | None = None) -> int:
    """Run the plan, restarting after failures; the exit status for `mpdl launch`."""
    say = say or (lambda text: print(f"mpdl launch: {text}", file=sys.stderr, flush=True))
    check(plan)
    launcher = launcher or find_launcher()
    ranks, hostfile = plan.ranks, plan.hostfile
    hosts = read_hostfile(hostfile) if hostfile else None
    directory = checkpoint_dir(plan.train_args)
    flight = os.path.abspath(os.path.join(directory, "flight") if directory else "mpdl-flight")
    train_args = plan.train_args
    failures: list[Failure] = []
    scratch = tempfile.mkdtemp(prefix="mpdl-launch-")
    try:
        for attempt in range(plan.max_restarts + 1):
            statuses = os.path.join(scratch, f"status-{attempt + 1}")
            os.mkdir(statuses)
            cmd = launcher.command(ranks, hostfile, [*WATCHER, "--status", statuses, "--flight",
                                                     flight, *PROGRAM, *train_args])
            say(f"attempt {attempt + 1} of {plan.max_restarts + 1}: {' '.join(cmd)}")
            result = run_once(cmd, say, statuses)
            returncode = result.returncode
            if returncode == 0:
                restarts = f" after {attempt} restart(s)" if attempt else ""
                say(f"the job finished{restarts}")
                return 0
            failure = parse_failure(result.output, returncode, result.ranks_by_pid,
                                    result.vanished)
            failures.append(failure)
            say(f"attempt {attempt + 1} failed (exit status {returncode}): {failure.describe()}")
            if failure.status in FINAL_STATUSES and failure.signal is None:
                say(f"giving up: {FINAL_STATUSES[failure.status]} (exit status "
                    f"{failure.status}); a restart would not change that")
                return failure.status
            if attempt == plan.max_restarts:
                break
            if hosts is not None:
                hosts = live_hosts(launcher, hosts, say)
                slots = sum(s for _, s in hosts)
                if min(ranks, slots) < (plan.min_ranks or plan.ranks):
                    say(f"giving up: {slots} slot(s) on the hosts that answer, fewer than "
                        f"--min-ranks {plan.min_ranks or plan.ranks}")
                    return _give_up_status(failures)
                ranks = min(ranks, slots)
                hostfile = os.path.join(scratch, f"hosts-{attempt + 1}")
                Path(hostfile).write_text("".join(f"{h}:{s}\n" for h, s in hosts))
            say(f"restart {attempt + 1} of {plan.max_restarts} on {ranks} ranks, "
                f"{_resume_point(directory)}")
            train_args = _with_resume(plan.train_args)
        say(f"giving up after {len(failures)} failed attempt(s) (--max-restarts "
            f"{plan.max_restarts}); last: {failures[-1].describe()}")
        return _give_up_status(failures)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _give_up_status(failures: list[Failure]) -> int:
    code = failures[-1].returncode if failures else 1
    return code if 0 < code < 256 else 1


def _with_resume(train_args: list[str]) -> list[str]:
    return train_args if "--resume" in train_args else [*train_args, "--resume"]


def _resume_point(directory: str | None) -> str:
    """Where a restart resumes: the newest whole checkpoint's step, and how far into its epoch."""
    if directory is None or not checkpoint.has_checkpoint(directory):
        return "from the start (no checkpoint yet)"
    try:
        state: Any = checkpoint.load_checkpoint(directory)[2]
    except checkpoint.CheckpointError as exc:
        return f"from the start ({exc})"
    sampler = state.get("sampler", {})
    done, position = int(state.get("epoch", 0)), int(sampler.get("position", 0))
    size, batch = int(sampler.get("dataset_size", 0)), int(sampler.get("global_batch_size", 0))
    steps = (size // batch if sampler.get("drop_last") else -(-size // batch)) if batch else 0
    where = f"at the end of epoch {done}" if done else "at the start of epoch 1"
    if 0 < position < steps:
        where = f"in epoch {done + 1}, {position} of its {steps} steps done"
    return f"resuming from {directory} at step {state.get('step')} ({where})"
