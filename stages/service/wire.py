"""The SDK's protobuf bodies, through the `.proto` module it ships (`tinker.proto.tinker_public_pb2`: the wire
format itself): the `forward_backward` request the SDK sends as protobuf, and the two results it accepts only as
protobuf, `ForwardBackwardOutput` and `SampleResponse`.

A datum is decoded to its input token ids and its loss inputs as 1-D numpy arrays, each as long as the tokens
(position i of every input belongs to the token predicted after input token i); anything else (images, audio,
sparse or 2-D inputs, provenance spans) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from stages.service.refusals import Refused, refuse_unless

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class Datum:
    tokens: np.ndarray  # int64 [n]: the model input
    inputs: dict[str, np.ndarray]  # loss input name -> [n] (int64 target_tokens, float32 the rest)


@dataclass(frozen=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tokens(chunks) -> np.ndarray:
    parts = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        refuse_unless(kind == "encoded_text", f"model_input chunk {kind!r} is not supported: text tokens only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _tensor(name: str, msg: pb.Tensor, length: int) -> np.ndarray:
    refuse_unless(msg.WhichOneof("encoding") == "dense", f"loss_fn_inputs[{name!r}] is sparse: send it dense")
    refuse_unless(msg.dtype in _DTYPES, f"loss_fn_inputs[{name!r}] has dtype {msg.dtype}: float32 or int64 only")
    array = np.frombuffer(msg.dense, dtype=_DTYPES[msg.dtype])
    refuse_unless(array.size == length and len(msg.shape) <= 1,
                  f"loss_fn_inputs[{name!r}] has shape {list(msg.shape)}; it must be [{length}], one value per "
                  "model input token")
    return array.astype(np.int64 if name == "target_tokens" else np.float32)


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """The SDK's `ForwardBackwardRequest` body; `Refused` for what this service does not take."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError: not a body the SDK sends
        raise Refused(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for datum in msg.data:
        refuse_unless(not datum.model_input_spans and not datum.loss_fn_input_spans,
                      "provenance spans (model_input_spans, loss_fn_input_spans) are not supported")
        tokens = _tokens(datum.model_input)
        refuse_unless(tokens.size > 0, "a datum's model_input is empty")
        inputs = {name: _tensor(name, t, tokens.size) for name, t in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    refuse_unless(bool(data), "forward_backward has no data")
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: per datum its target logprobs (`logprobs`, float32), and the metrics."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    record = out.loss_fn_outputs.add(num_datums=len(logprobs))
    parts = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    offsets = np.concatenate([[0], np.cumsum([p.nbytes for p in parts])]).astype(np.int64)
    record.fields["logprobs"].CopyFrom(pb.BatchedTensor(data=b"".join(p.tobytes() for p in parts),
                                                        offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return out.SerializeToString()


def sample_response(sequences: list[tuple[np.ndarray, np.ndarray, str]],
                    prompt_logprobs: np.ndarray | None = None) -> bytes:
    """A `SampleResponse` of (tokens, logprobs, "stop" | "length") per sample, and the prompt's logprobs when
    asked for (float32, NaN where there is none: the first token)."""
    out = pb.SampleResponse()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    for tokens, logprobs, reason in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    return out.SerializeToString()
