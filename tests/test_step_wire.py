"""Steps and sampled tokens survive the wire as packed columns, in both directions."""
from __future__ import annotations

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, SampledToken, ScheduledChunk, ScheduledChunks, StepBatch
from stagemesh.core.step_wire import sampled_from_pb, sampled_to_pb, step_from_pb, step_to_pb
from stagemesh.v1 import stage_pb2


def over_the_wire(batch: StepBatch) -> StepBatch:
    raw = step_to_pb(batch).SerializeToString()
    return step_from_pb(stage_pb2.StepBatch.FromString(raw))


def test_a_mixed_step_round_trips():
    # values exact in float32 (the wire's type for temperature)
    sampling = SamplingParams(temperature=0.5, top_k=5, seed=11, max_tokens=9, logprobs=2, stop_token_ids=(4,))
    batch = StepBatch(7, [NewSequence(3, [5, 6, 7, 8, 9], sampling)], [
        ScheduledChunk(1, [42], 17, [], True),  # decode, the last block still has room
        ScheduledChunk(2, [43], 32, [9], True),  # decode into a new block
        ScheduledChunk(3, [5, 6, 7], 0, [10, 11], False),  # the first chunk of a prompt
    ], finished_seq_ids=[0])
    back = over_the_wire(batch)
    assert back == batch
    assert list(back.chunks) == list(batch.chunks)
    assert back.num_tokens == 5


def test_a_preempted_sequence_comes_back_new_with_its_output():
    batch = StepBatch(3, [NewSequence(9, [1, 2], SamplingParams(max_tokens=4), [7, 7])],
                      [ScheduledChunk(9, [1, 2, 7, 7], 0, [0], True)], finished_seq_ids=[4])
    back = over_the_wire(batch)
    assert back.new_sequences[0].output_token_ids == [7, 7]
    assert back.finished_seq_ids == [4]
    assert back.chunks[0] == ScheduledChunk(9, [1, 2, 7, 7], 0, [0], True)


def test_an_empty_step_round_trips():
    batch = StepBatch(0, finished_seq_ids=[1, 2])
    back = over_the_wire(batch)
    assert back == batch and not back.chunks and back.num_tokens == 0


def test_chunk_columns_line_up():
    chunks = ScheduledChunks()
    chunks.append(5, [1, 2, 3], 0, [7], False)
    chunks.append(6, [4], 9, [], True)
    assert chunks.num_tokens == [3, 1] and chunks.token_ids == [1, 2, 3, 4]
    assert chunks.num_new_blocks == [1, 0] and chunks.new_block_ids == [7]
    assert chunks[1] == ScheduledChunk(6, [4], 9, [], True)
    assert ScheduledChunks.of(chunks) == chunks


def sampled_over_the_wire(sampled: list[SampledToken]) -> list[SampledToken]:
    reply = stage_pb2.ForwardResponse(sampled=sampled_to_pb(sampled))
    return sampled_from_pb(stage_pb2.ForwardResponse.FromString(reply.SerializeToString()).sampled)


def test_sampled_tokens_carry_logprobs_only_where_asked():
    sampled = [SampledToken(1, 10), SampledToken(2, 20, -0.5, [20, 3], [-0.5, -1.25]), SampledToken(3, 30),
               SampledToken(4, 40, -2.0)]
    back = sampled_over_the_wire(sampled)
    assert back == sampled
    assert back[0].logprob is None and back[0].top_token_ids == []
    assert back[3].logprob == -2.0 and back[3].top_token_ids == []
    msg = sampled_to_pb(sampled)
    assert list(msg.logprob_rows) == [1, 3] and len(msg.logprobs) == 2


def test_no_sampled_tokens():
    assert sampled_over_the_wire([]) == []
    assert sampled_from_pb(stage_pb2.ForwardResponse().sampled) == []


def test_tp_followers_take_the_step_as_received_with_the_tokens_rank_0_filled_in():
    from stagemesh.core.step import PLACEHOLDER
    from stage_worker.control import read_step_message, step_message

    def step() -> StepBatch:
        return StepBatch(4, [], [ScheduledChunk(1, [PLACEHOLDER], 9, [], True), ScheduledChunk(2, [43], 3, [], True),
                                 ScheduledChunk(5, [PLACEHOLDER], 20, [6], True)])

    raw = step_to_pb(step()).SerializeToString()
    rank0 = step()
    rank0.chunks.fill_placeholders([49151, 7])
    filled, received = read_step_message(step_message(raw, [49151, 7]))
    assert (filled, received) == ([49151, 7], raw)
    follower = step_from_pb(stage_pb2.StepBatch.FromString(received))
    follower.chunks.fill_placeholders(filled)
    assert follower == rank0
    assert read_step_message(step_message(raw, [])) == ([], raw)
