"""The worker side of every stored KV cache group, answering vLLM as one.

Each stored group has its own namespace, page file and geometry, so each gets its own
`WorkerSide` (`connector.worker`); they share one staging pool and one stats recorder.
This module splits a step's jobs by group and merges the sides' answers.

Imports no vLLM (the worker side's rule).

Contract:
    * One group: every call goes straight to its `WorkerSide` (the behaviour single-group
      models always had: failed loads as block ids, recomputed from the first one).
    * Several groups (vLLM's hybrid manager): a request is in `finished_sending` once
      every group that had save jobs for it has finished them, and in
      `finished_recving` once every group's load of it has ended. vLLM accepts no
      block-level load errors from a model with several groups (it raises), so a request
      whose load failed in any group is reported in `failed_recving` (vLLM recomputes it
      from its first token) and `load_errors` stays empty: a corrupt page of one group
      never leaves another group's pages in use — never a mixed prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .metadata import Hf3fsctlConnectorMetadata
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch


class GroupWorkers:
    """One `WorkerSide` per stored group (keyed by the group's index in vLLM's config)."""

    def __init__(self, sides: Mapping[int, WorkerSide]) -> None:
        assert sides, "at least one stored group"
        self.sides = dict(sides)
        self.primary = next(iter(self.sides.values()))
        self.hybrid = len(self.sides) > 1
        self._lock = threading.Lock()
        self._sending: dict[str, set[int]] = {}  # request → groups still saving it
        self._recving: dict[str, set[int]] = {}  # request → groups still loading it
        self._load_blocks: dict[str, set[int]] = {}  # request → block ids its loads fill
        self._failed: set[str] = set()  # requests with a failed load in some group

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every side picks its group's layers out of `kv_caches`."""
        for side in self.sides.values():
            side.register_kv_caches(kv_caches)

    def _split(self, meta: Hf3fsctlConnectorMetadata, group: int) -> Hf3fsctlConnectorMetadata:
        return Hf3fsctlConnectorMetadata(
            loads=[job for job in meta.loads if job.group == group],
            saves=[job for job in meta.saves if job.group == group],
        )

    def step_began(self) -> None:
        """An engine step began: every side's saves of the last step may start."""
        for side in self.sides.values():
            side.step_began()

    def handle_preemptions(self, preempted: list[str]) -> None:
        """Requests whose blocks vLLM may reuse from this step's forward on: every side."""
        for side in self.sides.values():
            side.handle_preemptions(preempted)

    def start_load_kv(self, meta: Hf3fsctlConnectorMetadata) -> None:
        """Start each group's loads on its side."""
        if not self.hybrid:
            self.primary.start_load_kv(meta)
            return
        with self._lock:
            for job in meta.loads:
                self._recving.setdefault(job.req_id, set()).add(job.group)
                self._load_blocks.setdefault(job.req_id, set()).update(job.block_ids)
        for group, side in self.sides.items():
            part = self._split(meta, group)
            if part.loads:
                side.start_load_kv(part)

    def wait_for_save(self, meta: Hf3fsctlConnectorMetadata) -> None:
        """Gather each group's save blocks on its side."""
        if not self.hybrid:
            self.primary.wait_for_save(meta)
            return
        with self._lock:
            for job in meta.saves:
                self._sending.setdefault(job.req_id, set()).add(job.group)
        for group, side in self.sides.items():
            part = self._split(meta, group)
            if part.saves:
                side.wait_for_save(part)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids."""
        if not self.hybrid:
            sending, recving = self.primary.get_finished(finished_req_ids)
            return set(sending or ()), set(recving or ()), set()
        sent: set[str] = set()
        received: set[str] = set()
        for group, side in self.sides.items():
            sending, recving = side.get_finished(finished_req_ids)
            errors = side.get_block_ids_with_load_errors()
            with self._lock:
                if errors:
                    self._failed.update(
                        req for req, blocks in self._load_blocks.items() if blocks & errors
                    )
                for req in sending or ():
                    self._done(self._sending, req, group, sent)
                for req in recving or ():
                    self._done(self._recving, req, group, received)
        with self._lock:
            for req in received:
                self._load_blocks.pop(req, None)
            failed = self._failed & received
            self._failed -= failed
        return sent, received, failed

    @staticmethod
    def _done(waiting: dict[str, set[int]], req: str, group: int, out: set[str]) -> None:
        groups = waiting.get(req)
        if groups is None:
            return
        groups.discard(group)
        if not groups:
            del waiting[req]
            out.add(req)

    def idle(self, finished_req_ids: set[str]) -> bool:
        """Whether no transfer can have ended or failed since the last step (the step
        with nothing in flight: answered without locks or set copies)."""
        if not self.hybrid:
            return self.primary.idle(finished_req_ids)
        return all(side.idle(finished_req_ids) for side in self.sides.values()) and not (
            self._sending or self._recving or self._failed
        )

    def load_errors(self) -> set[int]:
        """Failed block ids (one group only; several groups report failed requests)."""
        return set() if self.hybrid else self.primary.get_block_ids_with_load_errors()

    def health_level(self) -> int:
        """The worst health level of the sides."""
        if not self.hybrid:
            return self.primary.health.level
        return max(side.health.level for side in self.sides.values())

    def shutdown(self) -> None:
        """Shut every side down (each drains its saves first)."""
        for side in self.sides.values():
            side.shutdown()
