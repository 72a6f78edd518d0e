"""miles.train.offload on CPU tensors: storages leave and come back bit for bit, damaged copies are
caught, and the streamed optimizer updates exactly as the resident one. The training runs that use
them are tests/e2e/test_train_offload.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.offload import (
    DiskChunks,
    Offloader,
    OffloadError,
    OffloadSettings,
    storages,
)
from miles.train.optimizer_stream import StreamedOptimizer

register_cpu_ci(est_time=1, suite="stage-a-cpu")


class Holder:
    """What a backend hands the offloader: state tensors (two views of one storage among them) and a gradient."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.buffer = torch.randn(700, generator=gen)
        self.views = [self.buffer[:300].view(10, 30), self.buffer[300:]]
        self.other = torch.randn(33, 7, generator=gen)
        self.grad = torch.randn(50, generator=gen)

    def offload_tensors(self):
        return [*self.views, self.other], [self.grad]


def test_state_goes_to_disk_in_chunks_and_comes_back_bit_for_bit(tmp_path: Path):
    holder = Holder()
    before = [t.clone() for t in (holder.buffer, holder.other)]
    offloader = Offloader(OffloadSettings("disk", tmp_path, 1000, False), holder, rank=0)
    offloader.away()
    assert holder.buffer.untyped_storage().nbytes() == 0 and holder.other.untyped_storage().nbytes() == 0
    assert holder.grad.untyped_storage().nbytes() == 0
    chunks = sorted(p.name for p in (tmp_path / "rank0" / "offload").iterdir())
    assert chunks == [f"chunk_{i:05d}.bin" for i in range(4)]  # (700 + 231) * 4 bytes in 1000-byte chunks
    offloader.back()
    assert torch.equal(holder.buffer, before[0]) and torch.equal(holder.other, before[1])
    assert torch.equal(holder.views[1], before[0][300:])  # a view of the storage sees it again
    assert torch.equal(holder.grad, torch.zeros(50))
    assert list((tmp_path / "rank0" / "offload").iterdir()) == []


def test_host_copy_releases_and_restores(tmp_path: Path):
    holder = Holder()
    before = holder.other.clone()
    offloader = Offloader(OffloadSettings("cpu", None, 1 << 20, False), holder, rank=3)
    offloader.away()
    assert holder.other.untyped_storage().nbytes() == 0
    offloader.back()
    assert torch.equal(holder.other, before)


def test_a_damaged_chunk_is_refused_with_its_name(tmp_path: Path):
    holder = Holder()
    offloader = Offloader(OffloadSettings("disk", tmp_path, 1000, False), holder, rank=0)
    offloader.away()
    damaged = tmp_path / "rank0" / "offload" / "chunk_00002.bin"
    data = bytearray(damaged.read_bytes())
    data[17] ^= 0x40
    damaged.write_bytes(bytes(data))
    with pytest.raises(
        OffloadError, match=r"chunk_00002.bin: CRC-32 .* the offloaded trainer state is damaged"
    ):
        offloader.back()


def test_a_truncated_chunk_is_refused_with_its_name(tmp_path: Path):
    chunks = DiskChunks(tmp_path, 64)
    tensor = torch.arange(40, dtype=torch.float32)
    chunks.write(tensor.untyped_storage())
    chunks.finish()
    (tmp_path / "chunk_00001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(OffloadError, match=r"chunk_00001.bin: 10 of 64 bytes at offset 0: .* truncated"):
        chunks.read_all([torch.empty(40).untyped_storage()])


def test_offloading_never_pins_a_storage():
    """Exporting a storage to numpy makes torch refuse to resize it ever after; the offloader reads
    and writes storages without doing that, so a tensor can leave any number of times."""
    holder = Holder()
    offloader = Offloader(OffloadSettings("cpu", None, 1 << 20, False), holder, rank=0)
    for _ in range(3):
        offloader.away()
        offloader.back()
    assert all(s.resizable() for s in storages([holder.buffer, holder.other, holder.grad]))


def _model_and_grads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((64, 32), (32,), (300,), (5, 5))
    ]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    return params, grads


def test_the_streamed_optimizer_updates_exactly_as_the_resident_one(tmp_path: Path):
    resident, grads = _model_and_grads(1)
    streamed_params = [torch.nn.Parameter(p.detach().clone()) for p in resident]
    opt = torch.optim.AdamW(
        [{"params": streamed_params[:2]}, {"params": streamed_params[2:], "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
    )
    plain = torch.optim.AdamW(
        [{"params": resident[:2]}, {"params": resident[2:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    streamed = StreamedOptimizer(opt, tmp_path, chunk_bytes=4096, rank=0)
    assert len(streamed.buckets) == 2  # 16 KiB of moments alone, then 256 + 2400 + 200 bytes together
    for step in grads:
        for p, q, g in zip(resident, streamed_params, step, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        opt.step()
        for p, q in zip(resident, streamed_params, strict=True):
            assert torch.equal(p, q)
        moments = [v for held in opt.state.values() for v in held.values() if v.dim()]
        assert moments and all(v.untyped_storage().nbytes() == 0 for v in moments)  # on disk between steps
    with streamed.resident():
        for p, q in zip(resident, streamed_params, strict=True):
            assert torch.equal(plain.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
    assert all(group["params"] for group in opt.param_groups)


def test_a_step_inside_resident_keeps_the_state_it_creates_for_a_checkpoint_load(tmp_path: Path):
    """torch.distributed.checkpoint's get_state_dict creates a fresh optimizer's state by a step at
    lr 0 and then loads into those tensors; released by that step, the load would write into
    freed memory (a resumed run crashed so)."""
    params, grads = _model_and_grads(2)
    opt = torch.optim.AdamW(params, lr=1e-2)
    streamed = StreamedOptimizer(opt, tmp_path, chunk_bytes=4096, rank=0)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    with streamed.resident():
        opt.step()
        moments = [v for held in opt.state.values() for v in held.values() if v.dim()]
        assert all(v.untyped_storage().nbytes() == v.numel() * 4 for v in moments)
        for v in moments:
            v.fill_(0.5)  # what a load writes
    assert all(v.untyped_storage().nbytes() == 0 for v in moments)  # on disk again
    with streamed.resident():
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in moments)


def _args(*argv: str):
    return parse_config(["--hf-checkpoint", "m", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--offload-train-target", "disk"), "add --offload-train"),
        (
            ("--offload-train", "--offload-train-disk-dir", "/x"),
            "--offload-train-disk-dir shape(s) the disk offload",
        ),
        (
            ("--offload-train", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "/x"),
            "needs --offload-train-target disk",
        ),
        (("--offload-train", "--offload-train-target", "disk"), "the disk offload needs a directory"),
        (
            ("--train-backend", "ddp", "--dp-replicate-size", "2"),
            "--dp-replicate-size shape(s) how FSDP shards",
        ),
        (("--debug-train-only",), "add --load-debug-rollout-data PATH"),
        (("--ci-check-model-hash",), "no --load was given"),
        (("--ci-save-grad-norm", "a.json", "--ci-load-grad-norm", "a.json"), "both name a.json"),
    ],
)
def test_flags_that_cannot_act_together_are_refused(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("SCRATCH", raising=False)
    with pytest.raises(SystemExit):
        _args(*argv)
    assert message in capsys.readouterr().err


def test_replayed_rollouts_imply_training_without_an_engine_and_scratch_names_the_disk(monkeypatch):
    assert _args("--load-debug-rollout-data", "r_{rollout_id}.json").checks.debug_train_only
    monkeypatch.setenv("SCRATCH", "/scratch")
    job = _args("--offload-train", "--offload-train-target", "disk").job
    assert job.offload_train_disk_dir.startswith("/scratch/miles_train_offload_")


# --- the Megatron optimizer format a checkpoint loads in (miles.megatron.checkpoint) -----------


def test_a_dp_reshardable_optimizer_state_refuses_another_model_parallel_layout():
    from miles.megatron.checkpoint import (
        OPTIMIZER_FORMAT,
        RESHARDABLE_FORMAT,
        CheckpointMismatch,
        saved_optimizer_format,
    )
    from miles.parallel import ParallelLayout

    at_tp2 = {"tp": 2, "pp": 1, "vpp": None, "ep": 1, "etp": 2, "cp": 1}
    saved = {"steps_done": 4, "format": OPTIMIZER_FORMAT, "layout": at_tp2}
    assert saved_optimizer_format("ckpt", saved, ParallelLayout(tp=2, sp=True)) == OPTIMIZER_FORMAT
    with pytest.raises(CheckpointMismatch, match=r"ckpt: .*dp_reshardable format.*\(tp 2 -> 1, etp 2 -> 1\).*"
                       r"--dist-ckpt-optim-fully-reshardable"):  # fmt: skip
        saved_optimizer_format("ckpt", saved, ParallelLayout())
    reshardable = {**saved, "format": RESHARDABLE_FORMAT}
    assert saved_optimizer_format("ckpt", reshardable, ParallelLayout()) == RESHARDABLE_FORMAT
