//! Reading a Manta checkpoint back whole, whoever wrote it: one trainer
//! (`optimizer.safetensors`), or data-parallel ranks (`optimizer.rank<r>-of-<n>.safetensors`,
//! ZeRO-2 or ZeRO-3). Every file is memory-mapped and read a tensor at a time, so an
//! export never holds the model twice.
//!
//! The weights file (`model.safetensors`) holds the model in the kind it computed with;
//! the optimizer files hold fp32 masters (a bf16 run's, or a ZeRO rank's slice of every
//! bucket). Both are read and checked against each other: a master rounded to the
//! weights' kind must be the saved weight bit for bit, since the trainer makes its
//! weights exactly that way. A shard of another run or step fails that check and is
//! named; a shard of another model or rank count already fails its length.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

use super::ExportError;
use crate::data_parallel::layout::FlatLayout;
use crate::data_parallel::zero::{
    shard_file_name, stage3_groups, BUCKET_NUMEL_KEY, DEFAULT_BUCKET_NUMEL, ZERO_STAGE_KEY,
};
use crate::trainer::TrainerState;

/// The one-trainer optimizer file.
const WHOLE_OPTIMIZER: &str = "optimizer.safetensors";

/// A memory-mapped safetensors file of the checkpoint.
struct Mapped {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl Mapped {
    fn open(path: PathBuf) -> Result<Self, ExportError> {
        let file = File::open(&path).map_err(|e| ExportError::file(&path, e.to_string()))?;
        // SAFETY: read-only map, dropped with the export; a checkpoint rewritten while it
        // is exported is outside what any reader can guard against.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| ExportError::file(&path, e.to_string()))?;
        let mapped = Self { path, map };
        mapped.parse()?;
        Ok(mapped)
    }

    /// The file's header and tensors; a truncated or foreign file fails here, named.
    fn parse(&self) -> Result<SafeTensors<'_>, ExportError> {
        SafeTensors::deserialize(&self.map).map_err(|e| {
            ExportError::file(
                &self.path,
                format!("not a complete safetensors file (truncated or torn?): {e:?}"),
            )
        })
    }

    /// Where tensor `key`'s bytes lie in the file, with its dtype and shape.
    fn locate(&self, key: &str) -> Result<Option<Located>, ExportError> {
        let parsed = self.parse()?;
        let Ok(view) = parsed.tensor(key) else {
            return Ok(None);
        };
        let data = view.data();
        let start = data.as_ptr() as usize - self.map.as_ptr() as usize;
        Ok(Some(Located {
            bytes: start..start + data.len(),
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
        }))
    }

    /// An integer scalar the optimizer wrote beside its tensors (`None`: not written).
    fn scalar(&self, key: &str) -> Result<Option<i64>, ExportError> {
        let Some(found) = self.locate(key)? else {
            return Ok(None);
        };
        let bytes = &self.map[found.bytes];
        match (found.dtype, <[u8; 8]>::try_from(bytes)) {
            (Dtype::I64, Ok(b)) => Ok(Some(i64::from_le_bytes(b))),
            _ => Err(ExportError::tensor(
                &self.path,
                key,
                format!(
                    "expected one int64, found {:?} {:?}",
                    found.dtype, found.shape
                ),
            )),
        }
    }
}

/// One tensor's place in a mapped file.
struct Located {
    bytes: Range<usize>,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// A parameter of the checkpoint, as the weights file holds it.
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    /// The kind the trainer computed with (bf16 or fp32).
    pub dtype: Dtype,
    /// Its bytes in `model.safetensors`.
    bytes: Range<usize>,
}

impl Param {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where the fp32 masters are.
enum Masters {
    /// An fp32 run of one trainer: the weights are the masters.
    None,
    /// One trainer's bf16 run: `master.<name>` in `optimizer.safetensors`, by parameter.
    Whole {
        file: Mapped,
        ranges: Vec<Range<usize>>,
    },
    /// Data-parallel ranks: each rank's flat slice of every bucket.
    Sharded {
        stage: i64,
        layout: FlatLayout,
        /// Each parameter's slot in `layout.params`, in [`Checkpoint::params`] order.
        slots: Vec<usize>,
        shards: Vec<(Mapped, Range<usize>)>,
    },
}

/// A piece of a parameter's master held by one file: the file's index (in the order
/// [`Checkpoint::describe`] names them), the bytes there, and which elements of the
/// parameter they are.
struct Piece {
    file: usize,
    bytes: Range<usize>,
    elements: Range<usize>,
}

/// A Manta checkpoint directory, opened and laid out.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: TrainerState,
    /// config.json as saved (every key kept).
    pub config: serde_json::Value,
    weights: Mapped,
    /// Every parameter, by name.
    pub params: Vec<Param>,
    masters: Masters,
}

impl Checkpoint {
    /// Opens `dir` (a `step_NNNNNN` directory) and checks that its files belong together:
    /// every shard present, of one rank count and stage, each as long as the weights'
    /// layout over that many ranks says.
    pub fn open(dir: &Path) -> Result<Self, ExportError> {
        let state_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path).map_err(|e| {
            ExportError::file(
                &state_path,
                format!(
                    "{e} (a Manta checkpoint directory has one: is {} one?)",
                    dir.display()
                ),
            )
        })?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| ExportError::file(&state_path, e.to_string()))?;
        let config_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&config_path)
            .map_err(|e| ExportError::file(&config_path, e.to_string()))?;
        let model = manta_model::ModelConfig::from_json_str(&config_text, "config.json")
            .map_err(|e| ExportError::file(&config_path, e.to_string()))?;
        let config: serde_json::Value = serde_json::from_str(&config_text)
            .map_err(|e| ExportError::file(&config_path, e.to_string()))?;
        let weights = Mapped::open(dir.join("model.safetensors"))?;
        let params = weight_params(&weights)?;
        let masters = open_masters(dir, &params, model.num_hidden_layers.max(0) as usize)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            state,
            config,
            weights,
            params,
            masters,
        })
    }

    /// Who wrote the checkpoint, for messages: "one trainer", "ZeRO-3 shards of 2 ranks".
    pub fn describe(&self) -> String {
        match &self.masters {
            Masters::None | Masters::Whole { .. } => "one trainer".into(),
            Masters::Sharded { stage, shards, .. } => {
                format!("ZeRO-{stage} shards of {} ranks", shards.len())
            }
        }
    }

    /// Whether fp32 masters are kept apart from the weights (a bf16 run, or ZeRO shards).
    pub fn has_masters(&self) -> bool {
        !matches!(self.masters, Masters::None)
    }

    /// Parameter `i`'s bytes as the weights file holds them.
    pub fn weight_bytes(&self, i: usize) -> &[u8] {
        &self.weights.map[self.params[i].bytes.clone()]
    }

    /// Parameter `i`'s fp32 master (little-endian bytes), assembled from the files that
    /// hold its pieces; the weights themselves in an fp32 run of one trainer.
    pub fn master_bytes(&self, i: usize) -> Cow<'_, [u8]> {
        match &self.masters {
            Masters::None => Cow::Borrowed(self.weight_bytes(i)),
            Masters::Whole { file, ranges } => Cow::Borrowed(&file.map[ranges[i].clone()]),
            Masters::Sharded { .. } => {
                let mut out = Vec::with_capacity(self.params[i].numel() * 4);
                for piece in self.pieces(i) {
                    out.extend_from_slice(&self.master_file(piece.file).map[piece.bytes]);
                }
                Cow::Owned(out)
            }
        }
    }

    fn master_file(&self, index: usize) -> &Mapped {
        match &self.masters {
            Masters::Whole { file, .. } => file,
            Masters::Sharded { shards, .. } => &shards[index].0,
            Masters::None => &self.weights,
        }
    }

    /// Parameter `i`'s master, piece by piece, in element order.
    fn pieces(&self, i: usize) -> Vec<Piece> {
        let numel = self.params[i].numel();
        match &self.masters {
            Masters::None => Vec::new(),
            Masters::Whole { ranges, .. } => vec![Piece {
                file: 0,
                bytes: ranges[i].clone(),
                elements: 0..numel,
            }],
            Masters::Sharded {
                layout,
                slots,
                shards,
                ..
            } => {
                let slot = &layout.params[slots[i]];
                let bucket = &layout.buckets[slot.bucket];
                let (start, end) = (slot.offset, slot.offset + slot.numel);
                let s = bucket.shard;
                (0..shards.len())
                    .filter_map(|r| {
                        let (lo, hi) = (start.max(r * s), end.min((r + 1) * s));
                        (lo < hi).then(|| {
                            let at = shards[r].1.start + 4 * (bucket.shard_offset + lo - r * s);
                            Piece {
                                file: r,
                                bytes: at..at + 4 * (hi - lo),
                                elements: lo - start..hi - start,
                            }
                        })
                    })
                    .collect()
            }
        }
    }

    /// Checks every master against the weights: rounded to the weights' kind it must be
    /// the saved weight bit for bit (the trainer makes its weights exactly so). The first
    /// difference names the file holding that master and the parameter.
    pub fn verify(&self) -> Result<(), ExportError> {
        for (i, p) in self.params.iter().enumerate() {
            let weights = self.weight_bytes(i);
            let width = p.dtype.size();
            for piece in self.pieces(i) {
                let file = self.master_file(piece.file);
                let master = &file.map[piece.bytes.clone()];
                let rounded = f32_to(master, p.dtype).map_err(|e| {
                    ExportError::tensor(&file.path, &p.name, format!("converting: {e}"))
                })?;
                let saved = &weights[piece.elements.start * width..piece.elements.end * width];
                if rounded.as_ref() != saved {
                    return Err(ExportError::tensor(
                        &file.path,
                        &p.name,
                        format!(
                            "its fp32 master (elements {}..{}) does not round to the weights \
                             in {}: this optimizer file belongs to another run or step",
                            piece.elements.start,
                            piece.elements.end,
                            self.weights.path.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The parameters of the weights file, by name; each must be a float tensor.
fn weight_params(weights: &Mapped) -> Result<Vec<Param>, ExportError> {
    let parsed = weights.parse()?;
    let mut params: Vec<Param> = Vec::new();
    for (name, view) in parsed.tensors() {
        if !matches!(view.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(ExportError::tensor(
                &weights.path,
                &name,
                format!("{:?} is not a weight kind the trainer saves", view.dtype()),
            ));
        }
        let data = view.data();
        let start = data.as_ptr() as usize - weights.map.as_ptr() as usize;
        params.push(Param {
            name,
            shape: view.shape().to_vec(),
            dtype: view.dtype(),
            bytes: start..start + data.len(),
        });
    }
    if params.is_empty() {
        return Err(ExportError::file(&weights.path, "holds no tensors".into()));
    }
    params.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(params)
}

/// The optimizer files of `dir` and where each parameter's master lies in them.
fn open_masters(dir: &Path, params: &[Param], layers: usize) -> Result<Masters, ExportError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ExportError::file(dir, e.to_string()))?;
    let mut worlds: BTreeMap<usize, PathBuf> = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(|e| ExportError::file(dir, e.to_string()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((_, world)) = shard_rank(&name) {
            worlds.entry(world).or_insert_with(|| entry.path());
        }
    }
    let whole = dir.join(WHOLE_OPTIMIZER);
    if worlds.is_empty() {
        if !whole.is_file() {
            return Err(ExportError::file(
                dir,
                format!(
                    "no optimizer state ({WHOLE_OPTIMIZER} or optimizer.rank<r>-of-<n>.safetensors): \
                     not a complete Manta checkpoint"
                ),
            ));
        }
        return open_whole(Mapped::open(whole)?, params);
    }
    if worlds.len() > 1 {
        let found: Vec<String> = worlds.values().map(|p| p.display().to_string()).collect();
        return Err(ExportError::file(
            dir,
            format!(
                "optimizer shards of different rank counts ({}): shards of another run",
                found.join(", ")
            ),
        ));
    }
    if whole.is_file() {
        return Err(ExportError::file(
            &whole,
            "a one-trainer optimizer file beside data-parallel shards: files of two runs".into(),
        ));
    }
    let world = *worlds.keys().next().unwrap_or(&1);
    let mut shards = Vec::with_capacity(world);
    for r in 0..world {
        let path = dir.join(shard_file_name(r, world));
        if !path.is_file() {
            return Err(ExportError::file(
                &path,
                format!(
                    "missing: the checkpoint was saved by {world} ranks and every rank's shard \
                     is needed (ranks on other nodes keep theirs in their node's copy of the \
                     checkpoint: copy them here)"
                ),
            ));
        }
        shards.push(Mapped::open(path)?);
    }
    let stage = shards[0].scalar(ZERO_STAGE_KEY)?.unwrap_or(2);
    let bucket_numel = shards[0]
        .scalar(BUCKET_NUMEL_KEY)?
        .map_or(DEFAULT_BUCKET_NUMEL, |n| n.max(1) as usize);
    for shard in &shards[1..] {
        let (s, b) = (
            shard.scalar(ZERO_STAGE_KEY)?.unwrap_or(2),
            shard
                .scalar(BUCKET_NUMEL_KEY)?
                .map_or(DEFAULT_BUCKET_NUMEL, |n| n.max(1) as usize),
        );
        if s != stage || (stage == 2 && b != bucket_numel) {
            return Err(ExportError::file(
                &shard.path,
                format!(
                    "written by ZeRO-{s} (buckets of {b}), {} by ZeRO-{stage} (buckets of \
                     {bucket_numel}): shards of another run",
                    shards[0].path.display()
                ),
            ));
        }
    }
    let named: Vec<(String, Vec<i64>)> = params
        .iter()
        .map(|p| (p.name.clone(), p.shape.iter().map(|&d| d as i64).collect()))
        .collect();
    let layout = match stage {
        2 => FlatLayout::new(&named, world, bucket_numel),
        3 => {
            let groups = stage3_groups(named, layers)
                .map_err(|e| ExportError::file(&shards[0].path, e.to_string()))?;
            FlatLayout::grouped(&groups, world)
        }
        other => {
            return Err(ExportError::tensor(
                &shards[0].path,
                ZERO_STAGE_KEY,
                format!("ZeRO stage {other} is not one Manta writes (2 or 3)"),
            ))
        }
    };
    let mut located = Vec::with_capacity(world);
    for shard in shards {
        let master = shard
            .locate("master")?
            .ok_or_else(|| ExportError::tensor(&shard.path, "master", "missing".into()))?;
        if master.dtype != Dtype::F32 || master.shape != [layout.shard_numel] {
            return Err(ExportError::tensor(
                &shard.path,
                "master",
                format!(
                    "is {:?} {:?}; these weights over {world} ranks at ZeRO-{stage} make \
                     F32 [{}]: a shard of another model or rank count",
                    master.dtype, master.shape, layout.shard_numel
                ),
            ));
        }
        located.push((shard, master.bytes));
    }
    let by_name: BTreeMap<&str, usize> = layout
        .params
        .iter()
        .enumerate()
        .map(|(j, s)| (s.name.as_str(), j))
        .collect();
    let slots = params
        .iter()
        .map(|p| by_name.get(p.name.as_str()).copied().unwrap_or(0))
        .collect();
    Ok(Masters::Sharded {
        stage,
        layout,
        slots,
        shards: located,
    })
}

/// One trainer's `optimizer.safetensors`: masters by name in a bf16 run, none in fp32.
fn open_whole(file: Mapped, params: &[Param]) -> Result<Masters, ExportError> {
    let mut ranges = Vec::with_capacity(params.len());
    for p in params {
        let key = format!("exp_avg.{}", p.name);
        match file.locate(&key)? {
            Some(m) if m.shape == p.shape => {}
            Some(m) => {
                return Err(ExportError::tensor(
                    &file.path,
                    &key,
                    format!(
                        "has shape {:?}, the weight {:?}: another model's optimizer",
                        m.shape, p.shape
                    ),
                ))
            }
            None => {
                return Err(ExportError::tensor(
                    &file.path,
                    &key,
                    "missing: the optimizer of another model".into(),
                ))
            }
        }
        let key = format!("master.{}", p.name);
        match file.locate(&key)? {
            Some(m) if m.dtype == Dtype::F32 && m.shape == p.shape => ranges.push(m.bytes),
            Some(m) => {
                return Err(ExportError::tensor(
                    &file.path,
                    &key,
                    format!("is {:?} {:?}, expected F32 {:?}", m.dtype, m.shape, p.shape),
                ))
            }
            None if ranges.is_empty() => {}
            None => {
                return Err(ExportError::tensor(&file.path, &key, "missing".into()));
            }
        }
    }
    if ranges.is_empty() {
        return Ok(Masters::None);
    }
    if ranges.len() != params.len() {
        let missing = &params[ranges.len()].name;
        return Err(ExportError::tensor(
            &file.path,
            &format!("master.{missing}"),
            "missing".into(),
        ));
    }
    Ok(Masters::Whole { file, ranges })
}

/// (rank, world) of a shard file name `optimizer.rank<r>-of-<n>.safetensors`.
fn shard_rank(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("optimizer.rank")?;
    let (rank, world) = rest.strip_suffix(".safetensors")?.split_once("-of-")?;
    Some((rank.parse().ok()?, world.parse().ok()?))
}

/// The libtorch kind of a weight dtype.
pub(super) fn kind_of(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        _ => Kind::Float,
    }
}

/// Little-endian fp32 bytes as `dtype` (libtorch's rounding, as the trainer rounds its
/// masters into its weights).
pub(super) fn f32_to(bytes: &[u8], dtype: Dtype) -> Result<Cow<'_, [u8]>, tch::TchError> {
    convert(bytes, Dtype::F32, dtype)
}

/// `bytes` of `from` as `to`.
pub(super) fn convert(
    bytes: &[u8],
    from: Dtype,
    to: Dtype,
) -> Result<Cow<'_, [u8]>, tch::TchError> {
    if from == to {
        return Ok(Cow::Borrowed(bytes));
    }
    let n = (bytes.len() / from.size()) as i64;
    let t = Tensor::f_from_data_size(bytes, &[n], kind_of(from))?.f_to_kind(kind_of(to))?;
    let mut out = vec![0u8; n as usize * to.size()];
    t.f_copy_data_u8(&mut out, n as usize)?;
    Ok(Cow::Owned(out))
}
