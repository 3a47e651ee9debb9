"""What a default ModelCheckpoint leaves in its folder under zero2 after a run that crashes at epoch 3
(Lightning's test_ema_resume_ddp expects one entry).

    python ckpt_dir_listing.py ddp_spawn|zero2_spawn|zero2 [ROOT]

Under DDP the folder holds the checkpoint of the last finished epoch (epoch=2-step=6.ckpt); under zero2 with
the spawn launcher the newest one is missing (epoch=1-step=4.ckpt is what is left).
"""
import os
import sys
import tempfile

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_zero import ZeroLowLevelStrategy


class CrashAtEpoch3(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.current_epoch >= 3:
            raise RuntimeError("CRASH")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    which = sys.argv[1]
    strategy = ZeroLowLevelStrategy(stage=2, start_method="spawn") if which == "zero2_spawn" else which
    # The popen launcher runs this script again per rank: the folder comes from the command line.
    root = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=8, limit_train_batches=2,
                      limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)
    try:
        trainer.fit(CrashAtEpoch3())
    except Exception as error:  # the spawn launcher raises its own wrapper
        print("raised:", error)
    if trainer.is_global_zero:
        for folder, _, files in sorted(os.walk(os.path.join(root, "checkpoints"))):
            print(which, os.path.relpath(folder, root), sorted(files))
