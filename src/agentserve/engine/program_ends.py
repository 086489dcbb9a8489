"""A program's end on the scheduler's side: ended by its client (its pin
dropped, its chain retired to the cold end where the policy says so), released
(its pin and protected place dropped, the program kept), or found idle past
the idle timeout (ended for the statistics too: on a live server most programs
end this way). A mixin of `Scheduler` (engine/scheduler.py), sharing its state."""

from __future__ import annotations

from agentserve.policy.program import ProgramState

# Idle programs are looked for this many times per idle timeout (not every
# step: the look builds the set of busy programs).
EXPIRY_CHECKS_PER_TIMEOUT = 16


class ProgramEnds:
    def end_program(self, program_id: str) -> ProgramState | None:
        """The program is done: drop its pin and forget it. Its state (None if
        the table did not know it)."""
        now = self.clock.now()
        if self._unpin(program_id, now, protect=False):
            self.stats.pins_released_at_end += 1
        self.prefetcher.drop(program_id)
        self.kv.unprotect(program_id)
        prog = self.programs.end(program_id)
        if prog is not None:
            self._retire(prog.chain)
            self.policy.on_program_end(prog)
        return prog

    def _retire(self, chain) -> None:
        """An ended program's chain (its last turn's ChainHint): to the cold end, if the policy says so."""
        if self.policy.retire_ended:
            self.stats.retired_blocks += self.kv.retire(chain)

    def release_program(self, program_id: str) -> bool:
        """A client's explicit release: drop the pin (and the program's place in
        the protected zone), keep the program."""
        released = self._unpin(program_id, self.clock.now(), protect=False) > 0
        self.prefetcher.drop(program_id)
        return self.kv.unprotect(program_id) > 0 or released

    def _unpin(self, program_id: str, now: float, protect: bool = True) -> int:
        """Release a program's pin (the blocks it held; 0: it had none). Its waiting
        requests take their new places: a priority may depend on the pin.
        `protect`: the program goes on, so its blocks may enter the protected zone."""
        n = self.kv.unpin(program_id, now, protect)
        if n:
            self._overdue.discard(program_id)
            self.waiting.replace_program(program_id, now)
        return n

    def expire_programs(self, now: float | None = None) -> None:
        """End the programs idle for longer than the idle timeout (looked for a
        few times per timeout; a server calls this while idle too)."""
        now = self.clock.now() if now is None else now
        if now >= self._next_expiry:
            self._expire_idle(now)
            self._next_expiry = now + self.programs.idle_timeout / EXPIRY_CHECKS_PER_TIMEOUT

    def _expire_idle(self, now: float) -> None:
        """Programs whose clients went quiet without ending them end here, for
        the statistics too: on a live server most programs end this way."""
        busy = {r.program_id for r in self.running} | {r.program_id for r in self.waiting} | set(self.kv.pins)
        for prog in self.programs.expire_idle(now, busy):
            self.kv.unprotect(prog.program_id)
            self.prefetcher.drop(prog.program_id)
            self._retire(prog.chain)
            self.policy.on_program_end(prog)
