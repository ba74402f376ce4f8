//! A rank's optimizer shard on disk: masters and moments, with the ZeRO stage and
//! bucket size that lay them out.

use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;

use super::super::ReduceOp;
use super::optimizer::{ZeroAdamW, BUCKET_NUMEL_KEY, ZERO_STAGE_KEY};

/// The name of rank `rank`'s optimizer shard in a checkpoint of `world` ranks.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer.rank{rank}-of-{world}.safetensors")
}

impl ZeroAdamW {
    pub(super) fn shard_file(&self, dir: &Path) -> std::path::PathBuf {
        dir.join(shard_file_name(self.comm.rank(), self.layout.world))
    }

    /// Writes this rank's shard (masters and moments, flat) to
    /// `optimizer.rank<r>-of-<world>.safetensors` in `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        // The stage goes with the shard: the two stages lay the flat slices out
        // differently, so a resume must use the stage that saved them.
        let stage = Tensor::from(self.zero_stage());
        let bucket_numel = Tensor::from(self.bucket_numel as i64);
        // Moments not allocated yet (a ZeRO-3 optimizer saved before `release_all`) are
        // the zeros they would start as.
        let unallocated = self.exp_avg.numel() != self.master.numel();
        let zeros = unallocated.then(|| self.master.zeros_like());
        let (m, v) = match &zeros {
            Some(z) => (z, z),
            None => (&self.exp_avg, &self.exp_avg_sq),
        };
        let named = [
            ("master", &self.master),
            ("exp_avg", m),
            ("exp_avg_sq", v),
            (ZERO_STAGE_KEY, &stage),
            (BUCKET_NUMEL_KEY, &bucket_numel),
        ];
        Tensor::write_safetensors(&named, self.shard_file(dir))
    }

    /// 2 or 3 (`--zero-stage`).
    pub(super) fn zero_stage(&self) -> i64 {
        if self.stage3 {
            3
        } else {
            2
        }
    }

    /// Restores the shard [`ZeroAdamW::save`] wrote (same world size and model), then
    /// refreshes every rank's parameters from the masters.
    pub fn load(&mut self, dir: &Path, step: u64) -> Result<(), String> {
        let staged = self.read_shard(dir);
        // Every rank learns whether all ranks read their shard before the all-gather
        // below, so one unreadable shard stops every rank instead of leaving the others
        // waiting in it.
        let mut failed = [f64::from(u8::from(staged.is_err()))];
        self.comm
            .all_reduce_f64(&mut failed, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let staged = staged?;
        if failed[0] > 0.0 {
            return Err("another data-parallel rank could not read its optimizer shard".into());
        }
        self.allocate_state();
        tch::no_grad(|| {
            self.master.copy_(&staged[0]);
            self.exp_avg.copy_(&staged[1]);
            self.exp_avg_sq.copy_(&staged[2]);
            if let Some(shard) = &mut self.param_shard {
                shard.copy_(&self.master);
            }
        });
        self.step = step;
        if self.stage3 {
            return Ok(());
        }
        self.gather_params().map_err(|e| e.to_string())
    }

    /// This rank's saved master, first and second moments, checked against the layout.
    pub(super) fn read_shard(&self, dir: &Path) -> Result<Vec<Tensor>, String> {
        let path = self.shard_file(dir);
        let tensors =
            Tensor::read_safetensors(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let map: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        // Shards written before the stage was recorded are ZeRO-2's.
        let saved = map.get(ZERO_STAGE_KEY).map_or(2, |t| t.int64_value(&[]));
        if saved != self.zero_stage() {
            return Err(format!(
                "{}: saved by --zero-stage {saved} ranks, and this run uses --zero-stage {}: \
                 resume with --zero-stage {saved} (the stages lay the shards out differently)",
                path.display(),
                self.zero_stage()
            ));
        }
        let mut staged = Vec::new();
        for key in ["master", "exp_avg", "exp_avg_sq"] {
            let t = map
                .get(key)
                .ok_or_else(|| format!("{}: missing tensor {key}", path.display()))?;
            if t.size() != [self.layout.shard_numel as i64] {
                return Err(format!(
                    "{}: tensor {key} has shape {:?}, expected [{}] (another world size or model?)",
                    path.display(),
                    t.size(),
                    self.layout.shard_numel
                ));
            }
            staged.push(t.shallow_clone());
        }
        Ok(staged)
    }
}
