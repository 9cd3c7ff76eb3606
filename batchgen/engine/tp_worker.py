"""The process of one tensor-parallel rank > 0: build its share of the model, then run each step
rank 0 describes, in lockstep with it (see batchgen.engine.tensor_parallel).

Started by rank 0 as `python -m batchgen.engine.tp_worker`; never run by hand.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

from batchgen.distributed.group import (
    TensorParallel,
    TensorParallelError,
    default_threads,
    make_store,
)
from batchgen.distributed.watchdog import Watchdog
from batchgen.distributed.workers import Rank0Link
from batchgen.engine.model_runner import ModelRunner, resolve_device
from batchgen.engine.tensor_parallel import WorkerSetup, rank_device


def main() -> int:
    link, setup = Rank0Link.connect()
    assert isinstance(setup, WorkerSetup)
    tp = None
    try:
        device = rank_device(resolve_device(setup.config.device), setup.rank)
        if device.type == "cpu":
            torch.set_num_threads(default_threads(setup.size))
        store = make_store(setup.rank, setup.size, setup.store_port)
        tp = TensorParallel.start(setup.rank, setup.size, device, store)

        def stuck(message: str) -> None:
            # A start-up phase made no progress (the watchdog printed the stacks): rank 0 gets
            # the message, and this rank's exit ends the wait of every other rank.
            link.report(TensorParallelError(message))
            sys.stderr.flush()
            os._exit(1)

        runner = ModelRunner(
            setup.config,
            setup.model_config,
            setup.max_model_len,
            build=setup.build,
            tp=tp,
            peers=link,
            watchdog=Watchdog(setup.rank, stuck),
        )
        link.serve(runner.execute)
        return 0
    except SystemExit as e:  # rank 0 said stop while starting
        return int(e.code or 0)
    except BaseException as e:
        traceback.print_exc()
        link.report(e)
        return 1
    finally:
        if tp is not None:
            tp.close()


if __name__ == "__main__":
    sys.exit(main())
