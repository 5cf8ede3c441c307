"""`create_full_training_client(service, base_model)`: a full fine-tuning training client of the official `tinker`
SDK, for `baton serve` (or any Tinker service that trains full weights).

The SDK (0.38) has no public method for it: `ServiceClient.create_lora_training_client` always sends a
`LoraConfig` (its `_create_lora_training_client_submit` builds one from `rank`), and no other `ServiceClient`
method sends a `create_model`. Its wire types do carry it: `types.CreateModelRequest.lora_config` is optional
("Pass a LoRA config to create a new LoRA adapter", `tinker.resources.models.AsyncModelsResource.create`), and
the request is sent with `exclude_none`, so a request without one names no adapter: the service trains every
weight. This sends that request through the SDK's own client, exactly as `_create_lora_training_client_submit`
sends its own, and wraps the model in the SDK's `TrainingClient`, which is then used as any other.

Once a full model has been saved with `save_state`, the SDK's public `create_training_client_from_state(path)`
makes full fine-tuning clients too: a `load_weights` request carries no `lora_config`, the service takes the
model's kind from the checkpoint.

It reads SDK internals (the client holder, `_APIFuture`, `fetch_training_info`), as they are in the SDK range
baton's `tinker` extra pins (`tinker>=0.38,<0.39`).
"""

from __future__ import annotations

import time
from typing import Any


def create_full_training_client(service: Any, base_model: str, user_metadata: dict[str, str] | None = None) -> Any:
    """A future of a `tinker.TrainingClient` whose model trains every weight of `base_model` with AdamW (call
    `.result()`); `service` is a `tinker.ServiceClient`."""
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = service.holder
    session_id, model_seq_id = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> TrainingClient:
        start = time.time()
        request = types.CreateModelRequest(session_id=session_id, model_seq_id=model_seq_id, base_model=base_model,
                                           user_metadata=user_metadata, lora_config=None)
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            future = await client.models.create(request=request)
        created = await _APIFuture(types.CreateModelResponse, holder, future, request_start_time=start,
                                   request_type="CreateModel").result_async()
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=created.model_id,
                              info=await fetch_training_info(holder, created.model_id))

    return holder.run_coroutine_threadsafe(create())
