"""The process-wide state of bagua_comm: the bottom module that the process groups and the
backends both read (so neither imports the other to reach it).

:data:`state` holds what :func:`~bagua_comm.init_process_group` decided for this process (the
default group, the backend, the CUDA device, the job's timeout) and every group made since;
:func:`~bagua_comm.destroy_process_group` resets it.  It imports nothing of bagua_comm.
"""

from __future__ import annotations

from datetime import timedelta

#: The timeout of every group when ``init_process_group`` is not given one.
DEFAULT_TIMEOUT = timedelta(minutes=30)


class State:
    """What one process knows about the job (one instance: :data:`state`)."""

    def __init__(self):
        self.default = None              # the default ProcessGroup, None before init
        self.backend: str | None = None
        self.local_world_size = 1
        self.owns_torch_pg = False
        self.groups: list = []           # every ProcessGroup of this generation, in order
        self.cuda_device: int | None = None
        self.timeout = DEFAULT_TIMEOUT   # every group we create gets the job's timeout
        # counts init_process_group calls: survives the reset at destroy_process_group
        self.generation = getattr(self, "generation", 0)

    def reset(self) -> None:
        """Back to the uninitialised state (the generation is kept)."""
        self.__init__()

    def timeout_seconds(self) -> float:
        """The job's timeout in seconds (for NCCL's communicator creation and watchdog)."""
        return self.timeout.total_seconds()


state = State()
