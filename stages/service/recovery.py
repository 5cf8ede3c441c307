"""`recover`: a service started over the state folder of one that was killed comes back where it was.

From the journal and the committed learner states (`journal.plan`): the sessions and sampling sessions, the saved
samplers (their adapters read back from the state folder), and each model made again at its last committed step,
under the same request ids. A call finished up to the commit answers its recorded result; the calls accepted after
it (the `forward_backward`s that summed the pending gradient, an `optim_step` in flight, the saves that had not
finished) run again, in order, before any new call of that model. So the SDK, whose requests and result polls
retry through the outage, gets every answer it was waiting for, and no step is applied twice or lost.

A sample that was running is not journaled (it changes nothing): its request id is unknown after the restart,
answered 410, and the SDK's sampling client sends the sample again.

The journal is then rewritten with what a later restart needs (`journal.compacted`): the committed calls' bodies
and the results older than `Futures.keep_s` are dropped, so it does not grow with every restart's history.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from stages.service.calls import lora_of
from stages.service.futures import Result, call_id
from stages.service.journal import (
    SamplerRecord,
    SamplingRecord,
    SessionRecord,
    compacted,
    plan,
    read_journal,
    rewrite,
)

if TYPE_CHECKING:
    from stages.service.service import Service


async def _ready(result: Result) -> Result:
    return result


async def recover(service: Service) -> dict[str, int]:
    """Bring `service` back from its state folder (call it before serving, on the running event loop); what came
    back: sessions, samplers, models, results and calls run again, counted."""
    records = read_journal(service.store.folder)
    commits = service.store.commits()
    counts = dict.fromkeys(("sessions", "samplers", "models", "results", "rerun"), 0)
    for record in records:
        if isinstance(record, SessionRecord):
            service.sessions.restore(record.id)
            counts["sessions"] += 1
        elif isinstance(record, SamplingRecord):
            service.sampler_ids.restore(record.id)
            service.sampling_sessions[record.id] = record.path
        elif isinstance(record, SamplerRecord):
            weights = record.notice if record.notice is not None else service.store.load_sampler(record.file)
            await service.samplers.save(record.path, weights, record.at or None, record.version)
            counts["samplers"] += 1
    plans = plan(records, commits, time.time() - service.futures.keep_s)
    rewrite(service.store.folder, compacted(records, plans))
    service.journal.reopen()
    for model_id, model_plan in plans.items():
        service.order[model_id] = asyncio.Lock()
        service.last_seq[model_id] = model_plan.last_seq
        service.lora[model_id] = lora_of(model_plan.maker, service.checkpoints)
        maker = model_plan.maker
        service.run(maker, service.calls.work(maker, commits.get(model_id)))
        for seq, done in model_plan.finished.items():
            service.futures.start(_ready(done.outcome.result()), call_id(model_id, seq))
        for call in model_plan.rerun:
            service.run(call)
        counts["models"] += 1
        counts["results"] += len(model_plan.finished)
        counts["rerun"] += len(model_plan.rerun)
    return counts
