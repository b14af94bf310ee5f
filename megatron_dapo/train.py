"""`python -m megatron_dapo.train CONFIG [key=value ...]`: the DAPO run (also `megatron-dapo train`).

Launch one process per device: plain `python` for one process, `torchrun
--nproc-per-node N` on a node, `srun` under SLURM (see slurm/). A mistake in the config,
data or checkpoint prints one line and exits with code 2.

The work stays under `if __name__ == "__main__":` because megatron-core's checkpoint
writer starts a "spawn" process that re-imports the launching module.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from megatron_dapo.errors import (
    EXIT_USER_ERROR,
    SharedUserError,
    UserError,
    lost_peer,
    quiet_optional_backend_warnings,
)

# Dynamic sampling could not fill a batch: the run's data or policy, not its config, is at fault.
EXIT_DYNAMIC_SAMPLING = 3
# A second Ctrl-C (the first one saves after the current step and stops): the shell's code for SIGINT.
EXIT_INTERRUPTED = 130
# A rollout engine could not start, or died more often than rollout.max_engine_restarts allows
# (one line naming it, how it ended and its log).
EXIT_ENGINE_FAILED = 4
# Stopped early on SIGTERM/SIGUSR1/Ctrl-C after saving a checkpoint (preemption, a time limit):
# not a finished run (0) and not a failure; sysexits' EX_TEMPFAIL, "try again". The sbatch scripts
# requeue on it; rerunning the same command resumes.
EXIT_PREEMPTED = 75
# A rank whose peer died in a collective: the peer's error is the story, this rank's is an echo.
EXIT_PEER_GONE = 1
# The run directory already holds the checkpoint of the last step: nothing to train (one line naming
# the directory: raise trainer.total_training_steps to continue it, or give a new trainer.output_dir).
EXIT_NOTHING_TO_TRAIN = 5
# slurm/dapo.sbatch, never train itself: a preempted run was checkpointed but not requeued again, its
# MAX_REQUEUES restarts spent (submit the same job again to continue from the checkpoint).
EXIT_REQUEUES_EXHAUSTED = 6
# torchrun names the first rank to exit as the root cause and SIGTERMs the rest: the rank that
# only lost its peer waits this long so the failing rank's exit (and code) comes first.
PEER_GONE_GRACE_S = 5.0


def train(config_path: str, overrides: list[str]) -> dict[str, float]:
    """Load the config, build the run, train; returns the last metrics on the controller."""
    from megatron_dapo import parallel
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.run import build_run
    from megatron_dapo.trainer import Preempted, fit

    try:
        cfg = load_config(config_path, overrides)
    except UserError as e:
        raise SharedUserError(str(e)) from None  # every rank reads the same file: print it once
    run = build_run(cfg, config_path)
    try:
        return fit(run)
    except Exception as err:
        # A failure (not a user error or a preemption, whose lines main() prints) is named before
        # the engines and groups are stopped: should that ever hang, the log still says what ended
        # the run (a SLURM fleet job once hung there with its error unprinted).
        if not isinstance(err, (UserError, Preempted)):
            logging.getLogger(__name__).info("the run stops (%s: %s); shutting down", type(err).__name__,
                                             one_line(err))
        raise
    finally:
        run.close()
        parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    """Parse `CONFIG [overrides]`, train, and map user errors to exit code 2."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m megatron_dapo.train CONFIG [dotted.key=value ...]\n\n" + (__doc__ or ""))
        return 0 if args else EXIT_USER_ERROR
    from megatron_dapo.lifetime import die_with_launcher

    die_with_launcher()  # a kill -9 of the torchrun agent ends this rank too (lifetime.py)
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # megatron-core logs every parameter bucket and its optimizer config at INFO.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet_optional_backend_warnings()
    from megatron_dapo.algo import DynamicSamplingError
    from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted
    from megatron_dapo.run import NothingToTrain
    from megatron_dapo.trainer import Preempted

    try:
        train(args[0], args[1:])
    except UserError as e:
        line = f"error: {e}" if rank == "0" or not isinstance(e, SharedUserError) else None
        # Every rank raises a shared error at once, but torchrun SIGTERMs the others as soon as the first
        # one exits: a rank still unwinding would die with -15 (and rank 0 perhaps before printing).
        exit_on_sigterm(EXIT_USER_ERROR, line)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        # Ignored, not handled, from here: interpreter shutdown resets Python-level handlers to the
        # default (death by -15) but keeps SIG_IGN; the rank is about to exit 2 on its own.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return EXIT_USER_ERROR
    except Preempted as e:
        # Every rank stops at the same step, but the first to exit makes srun (--kill-on-bad-exit)
        # or torchrun SIGTERM the rest, and a rank still shutting down would die with -15 (143),
        # which the sbatch script does not take for a preemption: as for a shared user error.
        line = str(e) if rank == "0" else None
        exit_on_sigterm(EXIT_PREEMPTED, line)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return EXIT_PREEMPTED
    except NothingToTrain as e:
        line = f"error: {e}" if rank == "0" else None
        exit_on_sigterm(EXIT_NOTHING_TO_TRAIN, line)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return EXIT_NOTHING_TO_TRAIN
    except EngineRestartsExhausted as e:
        record_for_launcher(e)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENGINE_FAILED
    except EngineError as e:
        # An engine that died at start or failed for good: the first line names it, how it ended
        # (the signal, for a kill) and its log; the log's last lines stay in the log.
        record_for_launcher(e)
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_ENGINE_FAILED
    except DynamicSamplingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DYNAMIC_SAMPLING
    except RuntimeError as e:
        # Rank 0 too: when another rank fails mid-step, the controller is as much an echo.
        if not lost_peer(e):
            record_for_launcher(e)
            raise
        text = str(e)
        time.sleep(PEER_GONE_GRACE_S)
        first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
        from megatron_dapo.parallel import lost_ranks

        gone = lost_ranks(int(rank))
        print(f"rank {rank}: stopped: another rank exited during a collective ({first})"
              f"{'; ' + gone if gone else ''}; its error, if it printed one, is above", file=sys.stderr)
        return EXIT_PEER_GONE
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted; metrics.jsonl and checkpoints/ are consistent: rerun the same command "
              "to resume from the last checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        record_for_launcher(e)
        raise
    return 0


def one_line(err: BaseException) -> str:
    """The first line of an error's message, without the "last lines:" lead-in of an engine's log tail."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return first.removesuffix(", last lines:").removesuffix("; last lines:")


def exit_on_sigterm(code: int, line: str | None) -> None:
    """From now on SIGTERM prints `line` (if any) and exits with `code` at once: this rank has decided
    how it ends, and the launcher's SIGTERM (sent to the rest once one rank exits) must not turn that
    into -15."""
    def handler(signum: int, frame: object) -> None:
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        os._exit(code)

    signal.signal(signal.SIGTERM, handler)


def record_for_launcher(err: BaseException) -> None:
    """Leave `err` where torchrun's failure summary reads it (call it inside the `except`).

    torchrun then shows this rank's own error and traceback under "Root Cause" instead of
    "error_file: <N/A>", and dates the failure when it happened rather than when it saw the
    process end, so a peer's echo that exits first cannot take the root cause. A no-op
    outside torchrun (no TORCHELASTIC_ERROR_FILE).
    """
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(err)


if __name__ == "__main__":
    sys.exit(main())
