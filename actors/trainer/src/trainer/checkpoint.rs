//! Saving and loading checkpoints: one file set for one rank, a shard per rank for a group.

use std::path::Path;

use tch::Device;

use crate::data_parallel::Collective;

use super::*;

impl Trainer {
    /// Writes `dir/` with HF weights (config.json, model.safetensors), optimizer moments
    /// and trainer_state.json. Written to `dir.tmp` first and renamed, so an interrupted
    /// save never leaves a half checkpoint under the final name.
    pub fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerError> {
        if let Some(comm) = self.optimizer.collective() {
            return self.save_sharded_checkpoint(comm, dir, step);
        }
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        manta_model::save_pretrained(&self.vs, self.model.config(), &tmp)?;
        fault::crash_mid_save_if_asked(&tmp, step);
        self.optimizer.save(&tmp)?;
        let state = TrainerState {
            step,
            optimizer_steps: self.optimizer.step_count(),
        };
        let json = serde_json::to_string_pretty(&state).map_err(|e| err(e.to_string()))?;
        std::fs::write(tmp.join("trainer_state.json"), json).map_err(|e| err(e.to_string()))?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// [`Trainer::save_checkpoint`] of a data-parallel rank (every rank calls it, with a
    /// directory they all see): rank 0 writes the weights and trainer_state.json into
    /// `dir.tmp`, every rank its optimizer shard (`optimizer.rank<r>-of-<world>`), and
    /// rank 0 renames the directory once all are written. Where nodes keep their own
    /// disks, each node's owner ([`Trainer::set_checkpoint_owner`]) does rank 0's part
    /// in its node's directory. A failure on any rank fails the save on every rank.
    pub(super) fn save_sharded_checkpoint(
        &self,
        comm: &dyn Collective,
        dir: &Path,
        step: u64,
    ) -> Result<(), TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let tmp = dir.with_extension("tmp");
        // Rank 0, or the first rank of each node whose disk is its own.
        let owner = self.checkpoint_owner.unwrap_or(comm.rank() == 0);
        // ZeRO-3: every rank takes part in gathering the weights a shard group at a time;
        // the owner keeps host copies to write (the device holds one group beyond its shards).
        let gathered: Option<NamedTensors> = match self.optimizer.zero3() {
            Some(zero) => {
                let mut named = NamedTensors::new();
                zero.visit_buckets::<TrainerError>(|views| {
                    if owner {
                        named.extend(
                            views
                                .into_iter()
                                .map(|(k, t)| (k, t.to_device(Device::Cpu))),
                        );
                    }
                    Ok(())
                })?;
                Some(named)
            }
            None => None,
        };
        let weights = || -> Result<(), TrainerError> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
            }
            std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
            match &gathered {
                Some(named) => manta_model::save_pretrained_tensors(
                    named.iter().map(|(k, t)| (k.clone(), t.shallow_clone())),
                    self.model.config(),
                    &tmp,
                )?,
                None => manta_model::save_pretrained(&self.vs, self.model.config(), &tmp)?,
            }
            fault::crash_mid_save_if_asked(&tmp, step);
            let state = TrainerState {
                step,
                optimizer_steps: self.optimizer.step_count(),
            };
            let json = serde_json::to_string_pretty(&state).map_err(|e| err(e.to_string()))?;
            std::fs::write(tmp.join("trainer_state.json"), json).map_err(|e| err(e.to_string()))
        };
        let elsewhere = |what: &str| {
            let what = what.to_string();
            move || err(format!("another data-parallel rank failed to {what}"))
        };
        let local = if owner { weights() } else { Ok(()) };
        agree(comm, local, elsewhere("write the weights"))?;
        let local = self.optimizer.save(&tmp).map_err(TrainerError::from);
        agree(comm, local, elsewhere("write its optimizer shard"))?;
        let publish = || -> Result<(), TrainerError> {
            if dir.exists() {
                std::fs::remove_dir_all(dir).map_err(|e| err(e.to_string()))?;
            }
            std::fs::rename(&tmp, dir).map_err(|e| err(e.to_string()))
        };
        let local = if owner { publish() } else { Ok(()) };
        agree(comm, local, elsewhere("move the checkpoint into place"))
    }

    /// Restores weights, optimizer and step from a directory written by
    /// [`Trainer::save_checkpoint`]. Returns the step it was saved at.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64, TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let local = (|| -> Result<TrainerState, TrainerError> {
            let text = std::fs::read_to_string(dir.join("trainer_state.json"))
                .map_err(|e| err(format!("trainer_state.json: {e}")))?;
            let state: TrainerState =
                serde_json::from_str(&text).map_err(|e| err(format!("trainer_state.json: {e}")))?;
            // ZeRO-3's parameters hold nothing at rest: its optimizer shards (the fp32
            // masters) restore them.
            if self.optimizer.zero3().is_none() {
                manta_model::load_weights(&mut self.vs, dir)?;
            }
            Ok(state)
        })();
        // Data parallel: the optimizer's load runs collectives, so every rank first learns
        // whether all ranks read their checkpoint; one unreadable copy stops them all
        // instead of leaving the others waiting in an all-gather (NCCL would hang).
        let state = match self.optimizer.collective() {
            Some(comm) => {
                let (state, status) = match local {
                    Ok(state) => (Some(state), Ok(())),
                    Err(e) => (None, Err(e)),
                };
                agree(comm, status, || {
                    err("another data-parallel rank could not read the checkpoint".into())
                })?;
                state.ok_or_else(|| err("checkpoint state missing after agreement".into()))?
            }
            None => local?,
        };
        self.optimizer
            .load(dir, state.optimizer_steps)
            .map_err(err)?;
        Ok(state.step)
    }
}

/// One phase's outcome agreed by every data-parallel rank: this rank's error, or
/// `elsewhere()` when only another rank failed, so all ranks stop together.
pub(super) fn agree(
    comm: &dyn Collective,
    local: Result<(), TrainerError>,
    elsewhere: impl FnOnce() -> TrainerError,
) -> Result<(), TrainerError> {
    let mut failed = [f64::from(u8::from(local.is_err()))];
    comm.all_reduce_f64(&mut failed, crate::data_parallel::ReduceOp::Max)?;
    local?;
    if failed[0] > 0.0 {
        return Err(elsewhere());
    }
    Ok(())
}

/// Whether `dir` holds HF weights (single file or sharded).
pub fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists()
}
