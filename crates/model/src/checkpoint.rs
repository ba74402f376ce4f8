//! Hugging Face checkpoints: `config.json` plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped and copied tensor by tensor into
//! the VarStore's variables, so loading never holds a second copy of the model.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::moe::hub_tensors;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Loads model.safetensors or sharded model.safetensors.index.json from `dir` into the variables of `vs`
/// (copy under no_grad, converting dtype). Missing/unexpected/shape-mismatched tensors => ModelError naming file and tensor.
/// A tied model may lack lm_head.weight.
///
/// A checkpoint's `lm_head.weight` is ignored when the model is tied (it has no such variable),
/// and so are stale `rotary_emb.inv_freq` buffers that old checkpoints carry.
pub fn load_weights(vs: &mut VarStore, dir: &Path) -> Result<(), ModelError> {
    let files = checkpoint_files(dir)?;
    // Stacked expert variables are filled through per-expert views under the hub's names.
    let variables: HashMap<String, Tensor> = vs
        .variables()
        .iter()
        .flat_map(|(name, var)| hub_tensors(name, var))
        .collect();
    let mut maps = Vec::with_capacity(files.len());
    for file in &files {
        let handle = File::open(file).map_err(|e| ModelError::io(file, e))?;
        // SAFETY: the map is read-only and dropped before this function returns; a checkpoint
        // being rewritten underneath a running load is outside what any loader can guard.
        let mmap = unsafe { memmap2::Mmap::map(&handle) }.map_err(|e| ModelError::io(file, e))?;
        maps.push((file, mmap));
    }
    // First every name, shape and dtype is checked, then tensors are copied: a bad
    // checkpoint leaves the model as it was (an engine keeps serving its old weights).
    let mut loaded: HashSet<String> = HashSet::new();
    for (file, mmap) in &maps {
        for (name, view) in parse_safetensors(file, mmap)?.tensors() {
            let Some(var) = variables.get(&name) else {
                if name == "lm_head.weight" || name.ends_with("rotary_emb.inv_freq") {
                    tracing::debug!(tensor = %name, file = %file.display(), "ignoring tensor the model does not use");
                    continue;
                }
                return Err(ModelError::UnexpectedTensor {
                    path: (*file).clone(),
                    name,
                });
            };
            let found: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let expected = var.size();
            if found != expected {
                return Err(ModelError::ShapeMismatch {
                    path: (*file).clone(),
                    name,
                    expected,
                    found,
                });
            }
            if kind_of(view.dtype()).is_none() {
                return Err(ModelError::Dtype {
                    path: (*file).clone(),
                    name: name.clone(),
                    dtype: format!("{:?}", view.dtype()),
                });
            }
            loaded.insert(name);
        }
    }
    let mut missing: Vec<&String> = variables.keys().filter(|k| !loaded.contains(*k)).collect();
    missing.sort();
    if let Some(first) = missing.first() {
        return Err(ModelError::MissingTensor {
            dir: dir.to_path_buf(),
            name: (*first).clone(),
            more: missing.len() - 1,
        });
    }
    for (file, mmap) in &maps {
        for (name, view) in parse_safetensors(file, mmap)?.tensors() {
            let (Some(var), Some(kind)) = (variables.get(&name), kind_of(view.dtype())) else {
                continue;
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let src = Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| {
                ModelError::torch(format!("{}: reading `{name}`", file.display()), e)
            })?;
            let mut dst = var.shallow_clone();
            tch::no_grad(|| dst.f_copy_(&src)).map_err(|e| {
                ModelError::torch(
                    format!("{}: copying `{name}` into the model", file.display()),
                    e,
                )
            })?;
        }
    }
    Ok(())
}

fn parse_safetensors<'a>(file: &Path, mmap: &'a [u8]) -> Result<SafeTensors<'a>, ModelError> {
    SafeTensors::deserialize(mmap).map_err(|e| ModelError::Safetensors {
        path: file.to_path_buf(),
        message: e.to_string(),
    })
}

/// The safetensors files of a checkpoint: the single file if present (as transformers
/// prefers it), else the shards named by the index.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index_path = dir.join(INDEX_FILE);
    if !index_path.is_file() {
        return Err(ModelError::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("neither {SINGLE_FILE} nor {INDEX_FILE} exists in this directory"),
            ),
        ));
    }
    let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
    let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Index {
        path: index_path.clone(),
        message: e.to_string(),
    })?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(ModelError::Index {
            path: index_path,
            message: "key `weight_map` is missing or not an object".to_string(),
        });
    };
    let mut shards: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(ModelError::Index {
                path: index_path.clone(),
                message: format!("weight_map.{tensor}: file name {file} is not a string"),
            });
        };
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
    }
    shards.sort();
    let files: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
    for f in &files {
        if !f.is_file() {
            return Err(ModelError::Index {
                path: index_path.clone(),
                message: format!("shard {} does not exist", f.display()),
            });
        }
    }
    Ok(files)
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

/// A variable viewed for serialization; its bytes are copied to the host only when the
/// writer reaches it, so saving a GPU model needs one tensor of host memory at a time.
struct VarView {
    tensor: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl View for VarView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let host = self.tensor.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; self.data_len()];
        host.copy_data_u8(&mut bytes, host.numel());
        Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

/// Writes config.json + model.safetensors (HF names; no lm_head when tied) atomically (write to temp then rename).
///
/// Every variable of `vs` is written under its name (stacked expert weights under the
/// hub's per-expert names), with `{"format": "pt"}` metadata as
/// transformers requires.
pub fn save_pretrained(vs: &VarStore, cfg: &ModelConfig, dir: &Path) -> Result<(), ModelError> {
    save_pretrained_tensors(vs.variables(), cfg, dir)
}

/// [`save_pretrained`] of named tensors instead of a `VarStore`'s variables (weights
/// gathered from ranks that each hold a shard, ZeRO-3).
pub fn save_pretrained_tensors(
    tensors: impl IntoIterator<Item = (String, Tensor)>,
    cfg: &ModelConfig,
    dir: &Path,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut views: BTreeMap<String, VarView> = BTreeMap::new();
    for (name, var) in tensors
        .into_iter()
        .flat_map(|(name, var)| hub_tensors(&name, &var))
    {
        if cfg.tie_word_embeddings && name == "lm_head.weight" {
            continue;
        }
        let tensor = var.detach();
        let dtype = dtype_of(tensor.kind()).ok_or_else(|| ModelError::Dtype {
            path: dir.join(SINGLE_FILE),
            name: name.clone(),
            dtype: format!("{:?}", tensor.kind()),
        })?;
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        views.insert(
            name,
            VarView {
                tensor,
                dtype,
                shape,
            },
        );
    }
    let metadata: Option<HashMap<String, String>> =
        Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let weights = dir.join(SINGLE_FILE);
    let weights_tmp = dir.join(format!(".{SINGLE_FILE}.tmp"));
    safetensors::tensor::serialize_to_file(views, &metadata, &weights_tmp).map_err(|e| {
        ModelError::Safetensors {
            path: weights_tmp.clone(),
            message: e.to_string(),
        }
    })?;
    let config = dir.join("config.json");
    let config_tmp = dir.join(".config.json.tmp");
    std::fs::write(&config_tmp, cfg.to_json_pretty())
        .map_err(|e| ModelError::io(&config_tmp, e))?;
    std::fs::rename(&weights_tmp, &weights).map_err(|e| ModelError::io(&weights, e))?;
    std::fs::rename(&config_tmp, &config).map_err(|e| ModelError::io(&config, e))?;
    Ok(())
}
