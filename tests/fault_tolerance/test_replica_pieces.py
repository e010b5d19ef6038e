"""The pieces of fault tolerance that need no lighthouse: gradient buckets, data slots, the lighthouse check."""

import socket

import pytest
import torch

from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.fault_tolerance.data_share import data_slot, job_rank_coordinates
from dtrain.fault_tolerance.gradient_sum import buckets, sum_gradients
from dtrain.fault_tolerance.quorum_members import ReplicaError
from dtrain.fault_tolerance.replica_groups import check_lighthouse
from dtrain.step.state import RankCoordinates


def test_buckets_keep_dtypes_apart_and_stay_under_the_limit():
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30), torch.zeros(5)]
    runs = buckets(tensors, limit=160)  # 40 float32 values
    assert [[t.numel() for t in run] for run in runs] == [[10, 30], [5], [10]]
    assert all(len({t.dtype for t in run}) == 1 for run in runs)


def test_a_tensor_larger_than_the_limit_is_a_bucket_of_its_own():
    assert [[t.numel() for t in run] for run in buckets([torch.zeros(3), torch.zeros(100)], limit=16)] == [[3], [100]]


class SumOfTwoGroups:
    """A Manager whose all-reduce adds a second group holding the same gradients times ten."""

    def allreduce(self, tensor, reduce_op):
        tensor.mul_(11)
        return type("Done", (), {"wait": lambda self: None})()


def test_gradients_are_replaced_by_their_sum_over_the_groups_in_place():
    model = torch.nn.Linear(3, 2)
    model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.arange(2.0)
    weight_grad = model.weight.grad
    sum_gradients(SumOfTwoGroups(), list(model.parameters()))
    assert model.weight.grad is weight_grad
    assert torch.equal(model.weight.grad, torch.full((2, 3), 11.0))
    assert torch.equal(model.bias.grad, torch.tensor([0.0, 11.0]))


def test_each_group_takes_the_data_slots_after_the_groups_before_it():
    rank = RankCoordinates(dp_rank=1, dp_size=2)
    ft = FaultTolerance(enable=True, replica_id=2, group_size=3)
    assert data_slot(rank, ft) == (5, 6)
    assert job_rank_coordinates(rank, ft).rng_coords == ("dp", 5)
    assert data_slot(rank, FaultTolerance()) == (1, 2)


def test_a_lighthouse_that_does_not_answer_is_refused_in_one_line():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(ReplicaError, match=rf"torchft's lighthouse at http://localhost:{port} does not answer"):
        check_lighthouse(f"http://localhost:{port}")
    with pytest.raises(ReplicaError, match="is not an address; give http://host:port"):
        check_lighthouse("lighthouse-without-port")
