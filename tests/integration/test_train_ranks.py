"""Two ranks under torchrun take one torch process's steps: DDP, FSDP2, ZeRO-2, ZeRO-3,
and LoRA adapters under DDP.

Each rank trains on its token-balanced share of the batch and the ranks average their
gradients over gloo; the gathered checkpoint they write then resumes in one process, on the
torch engine and on DeepSpeed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sluice.config.tree import CriticConfig, LoraConfig
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore
from tests.support.cli import child_env
from tests.support.trainers import NO_TOKEN_LIMIT, make_trainer, step

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
STEPS = 3
# Gradients summed over two ranks and gloo, in another order than one torch process:
# equal to rounding (see tests/unit/engines/train/test_sharded_engines.py).
ATOL, RTOL = 1e-5, 1e-4
SETTINGS = {
    "lr": 5e-3,
    "clip_eps": 0.2,
    "grad_clip": 0.3,
    "micro_batch": 2,  # seven samples: the ranks take 3 and 4, and two or more passes each
    "warmup_steps": 1,
    "loss": "ppo",
    "threads": 1,
    "micro_batch_tokens": NO_TOKEN_LIMIT,
}


def _samples() -> list[Sample]:
    rows = []
    for i in range(7):
        response = [20 + (3 * i + j) % 11 for j in range(2 + i)] + [2]
        behaviour = [-3.0 - 0.1 * j for j in range(len(response))]
        rows.append(Sample([1, 30 + i], response, behaviour, advantage=(-1.0) ** i * (1 + i / 4)))
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(
    policy: Path,
    tmp_path: Path,
    engine: str,
    stage: int,
    lora: LoraConfig | None = None,
    packing: bool = False,
    critic: CriticConfig | None = None,
) -> dict:
    samples, train = tmp_path / "samples.json", tmp_path / "train.json"
    samples.write_text(json.dumps([asdict(s) for s in _samples()]))
    section = {
        **SETTINGS,
        "engine": engine,
        "lora": lora and lora.model_dump(),
        "packing": packing,
        "critic": critic and critic.model_dump(),
    }
    train.write_text(json.dumps({**section, **({"zero_stage": stage} if stage else {})}))
    out = tmp_path / "out"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
        *("--master_addr", "127.0.0.1", "--master_port", str(_free_port())),
        str(ROOT / "scripts" / "train_ranks.py"),
        *("--policy", str(policy), "--samples", str(samples), "--train", str(train)),
        *("--out", str(out), "--steps", str(STEPS)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize(
    ("engine", "stage", "resume_on", "packing"),
    [
        ("torch", 0, "deepspeed", False),
        # Packed: its start-up check runs a forward on the sharded model, and each step
        # follows a publish's gathers (a root unit left gathered stopped training there).
        ("fsdp", 0, "torch", True),
        ("deepspeed", 2, "torch", False),
        ("deepspeed", 3, "fsdp", False),
    ],
    ids=["ddp", "fsdp2-packed", "zero2", "zero3"],
)
def test_two_ranks_take_one_processs_steps(
    tiny_policy, tmp_path, engine, stage, resume_on, packing
):
    ranks = _torchrun(tiny_policy, tmp_path, engine, stage, packing=packing)
    assert ranks["world_size"] == 2
    reference = make_trainer(str(tiny_policy), **SETTINGS)
    for got in ranks["steps"]:
        want = step(reference, _samples())
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
    assert want["grad_norm"] > SETTINGS["grad_clip"]  # the clip was exercised

    # The checkpoint the two ranks gathered resumes in one process, on the other engine too.
    saved = CheckpointStore((tmp_path / "out").as_uri()).load_latest()
    assert saved is not None and saved.meta["version"] == STEPS
    resumed = _resume_elsewhere(tiny_policy, tmp_path, resume_on)
    step(reference, _samples())
    for name, tensor in reference.state().items():
        torch.testing.assert_close(resumed[name], tensor, atol=ATOL, rtol=RTOL)


RESUME = """
import json, sys
from safetensors.torch import save_file
from sluice.rl.batching import Sample
from sluice.storage.checkpoints import CheckpointStore
from tests.support.trainers import make_trainer, step

engine, policy, folder, out = sys.argv[1:5]
train = json.loads(open(f"{folder}/train.json").read())
for ran_there in ("engine", "zero_stage", "lora"):
    train.pop(ran_there, None)
samples = [Sample(**row) for row in json.loads(open(f"{folder}/samples.json").read())]
trainer = make_trainer(policy, engine=engine, **train)
saved = CheckpointStore(f"file://{folder}/out").load_latest()
trainer.load_checkpoint(saved.files, saved.meta)
step(trainer, samples)
save_file({k: v.contiguous() for k, v in trainer.state().items()}, out)
"""


def _resume_elsewhere(policy: Path, tmp_path: Path, engine: str) -> dict[str, torch.Tensor]:
    """The weights after the two ranks' checkpoint is loaded into ``engine`` in a process
    of its own (a world of one: no process group is left in the test's process, where a
    later test's library would find it) and one more step is taken."""
    out = tmp_path / "resumed.safetensors"
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", RESUME, engine, str(policy), str(tmp_path), str(out)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(out)


def test_two_ranks_train_lora_adapters_as_one_process(tiny_policy, tmp_path):
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    ranks = _torchrun(tiny_policy, tmp_path, "torch", 0, lora)
    reference = make_trainer(str(tiny_policy), **SETTINGS, lora=lora)
    for got in ranks["steps"]:
        want = step(reference, _samples())
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
    saved = CheckpointStore((tmp_path / "out").as_uri()).load_latest()
    assert saved is not None and "adapter_model.safetensors" in saved.files
    resumed = make_trainer(str(tiny_policy), **SETTINGS, lora=lora)  # no process group
    resumed.load_checkpoint(saved.files, saved.meta)
    for name, tensor in reference.state().items():
        torch.testing.assert_close(resumed.state()[name], tensor, atol=ATOL, rtol=RTOL)


def test_two_ranks_train_a_critic_as_one_process(tiny_policy, tmp_path):
    """The value loss reaches the shared trunk through DDP and the value head averages its
    own gradients over the ranks: the steps, and the critic's metrics, are one process's."""
    critic = CriticConfig(lr=1e-2)
    ranks = _torchrun(tiny_policy, tmp_path, "torch", 0, critic=critic)
    reference = make_trainer(str(tiny_policy), **SETTINGS, critic=critic)
    for got in ranks["steps"]:
        want = step(reference, _samples())
        assert {"value_loss", "value_grad_norm"} <= set(want) and set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
