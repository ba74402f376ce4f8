//! Writing an opened checkpoint as a Hugging Face model directory. Everything goes into
//! a hidden temporary directory beside `out`, is read back, and is renamed into place
//! last; an earlier export under `out` is replaced only then. A directory under `out`
//! that is not a Manta export is never replaced.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, View};

use super::checkpoint::{convert, Checkpoint};
use super::ExportError;

/// What every export writes beside the weights: where it came from. Its presence marks a
/// directory a later export may replace.
pub const EXPORT_MANIFEST: &str = "manta_export.json";

/// Files of a model directory that tokenize and configure generation; copied when the
/// run's model directory has them.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// The kind the exported weights are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDtype {
    /// The kind the trainer computed with (the checkpoint's `model.safetensors`), bit for
    /// bit: what the engines served.
    #[default]
    Auto,
    /// fp32: a bf16 run's fp32 master weights (gathered from the ranks' shards), or the
    /// fp32 weights themselves.
    Float32,
    /// bf16: the bf16 weights, or fp32 ones rounded to nearest even.
    BFloat16,
}

impl std::str::FromStr for ExportDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "float32" | "fp32" => Ok(Self::Float32),
            "bfloat16" | "bf16" => Ok(Self::BFloat16),
            other => Err(format!("{other:?}: one of auto, float32, bfloat16")),
        }
    }
}

/// How to export.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    pub dtype: ExportDtype,
    /// The run's model directory: its tokenizer and generation files are copied (the
    /// checkpoint holds none).
    pub tokenizer_from: Option<PathBuf>,
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    pub out: PathBuf,
    /// The checkpoint's training step.
    pub step: u64,
    /// Who wrote the checkpoint ("ZeRO-3 shards of 2 ranks").
    pub written_by: String,
    pub tensors: usize,
    /// "float32" or "bfloat16".
    pub dtype: &'static str,
    /// Whether the fp32 masters were written (else the weights as trained).
    pub from_masters: bool,
    /// Tokenizer and generation files copied.
    pub copied: Vec<String>,
}

/// Exports checkpoint `dir` to `out` as a Hugging Face model directory, after checking
/// the checkpoint's files against each other ([`Checkpoint::verify`]).
pub fn export(dir: &Path, out: &Path, opts: &ExportOptions) -> Result<Exported, ExportError> {
    let ckpt = Checkpoint::open(dir)?;
    ckpt.verify()?;
    let trained = ckpt.params[0].dtype;
    let (dtype, from_masters) = match opts.dtype {
        ExportDtype::Auto => (trained, false),
        ExportDtype::Float32 => (Dtype::F32, trained != Dtype::F32 && ckpt.has_masters()),
        ExportDtype::BFloat16 => (Dtype::BF16, false),
    };
    let name = out
        .file_name()
        .ok_or_else(|| ExportError::file(out, "--out needs a directory name".into()))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    check_replaceable(out)?;
    std::fs::create_dir_all(&parent).map_err(|e| ExportError::file(&parent, e.to_string()))?;
    let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let written = write_all(&ckpt, &tmp, dtype, from_masters, opts);
    let copied = match written {
        Ok(copied) => copied,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = move_into_place(&tmp, out, &parent, &name) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(Exported {
        out: out.to_path_buf(),
        step: ckpt.state.step,
        written_by: ckpt.describe(),
        tensors: ckpt.params.len(),
        dtype: dtype_name(dtype),
        from_masters,
        copied,
    })
}

/// `out` may be replaced: absent, empty, or an earlier export.
fn check_replaceable(out: &Path) -> Result<(), ExportError> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        return Err(ExportError::file(
            out,
            "--out exists and is not a directory".into(),
        ));
    }
    let empty = std::fs::read_dir(out)
        .map_err(|e| ExportError::file(out, e.to_string()))?
        .next()
        .is_none();
    if empty || out.join(EXPORT_MANIFEST).is_file() {
        return Ok(());
    }
    Err(ExportError::file(
        out,
        format!(
            "--out exists and is not an earlier export (no {EXPORT_MANIFEST}): not replaced; \
             remove it or choose another directory"
        ),
    ))
}

/// Writes the whole export into `tmp`; returns the tokenizer files copied.
fn write_all(
    ckpt: &Checkpoint,
    tmp: &Path,
    dtype: Dtype,
    from_masters: bool,
    opts: &ExportOptions,
) -> Result<Vec<String>, ExportError> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(|e| ExportError::file(tmp, e.to_string()))?;
    }
    std::fs::create_dir_all(tmp).map_err(|e| ExportError::file(tmp, e.to_string()))?;
    let weights = tmp.join("model.safetensors");
    let views: Vec<(String, OutTensor)> = (0..ckpt.params.len())
        .map(|i| {
            let p = &ckpt.params[i];
            let view = OutTensor {
                ckpt,
                index: i,
                dtype,
                shape: p.shape.clone(),
                from_masters,
            };
            (p.name.clone(), view)
        })
        .collect();
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::tensor::serialize_to_file(views, &metadata, &weights)
        .map_err(|e| ExportError::file(&weights, format!("writing: {e:?}")))?;
    check_written(ckpt, &weights, dtype)?;
    let mut config = ckpt.config.clone();
    if let Some(obj) = config.as_object_mut() {
        obj.insert("torch_dtype".into(), dtype_name(dtype).into());
        if obj.contains_key("dtype") {
            obj.insert("dtype".into(), dtype_name(dtype).into());
        }
    }
    write_json(&tmp.join("config.json"), &config)?;
    let mut copied = Vec::new();
    if let Some(from) = &opts.tokenizer_from {
        for file in TOKENIZER_FILES {
            let src = from.join(file);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(file))
                    .map_err(|e| ExportError::file(&src, format!("copying: {e}")))?;
                copied.push(file.to_string());
            }
        }
    }
    let manifest = serde_json::json!({
        "checkpoint": ckpt.dir.display().to_string(),
        "step": ckpt.state.step,
        "written_by": ckpt.describe(),
        "dtype": dtype_name(dtype),
        "weights": if from_masters { "fp32 master weights" } else { "the weights as trained" },
        "tokenizer_from": opts.tokenizer_from.as_ref().map(|p| p.display().to_string()),
    });
    write_json(&tmp.join(EXPORT_MANIFEST), &manifest)?;
    Ok(copied)
}

/// Reads the written weights back: every tensor present with its dtype and shape, and
/// the file as long as its header says (a short write is caught here, not by the loader).
fn check_written(ckpt: &Checkpoint, path: &Path, dtype: Dtype) -> Result<(), ExportError> {
    let file = std::fs::File::open(path).map_err(|e| ExportError::file(path, e.to_string()))?;
    // SAFETY: a read-only map of the file this export just wrote, in its private
    // temporary directory.
    let bytes =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ExportError::file(path, e.to_string()))?;
    let parsed = SafeTensors::deserialize(&bytes)
        .map_err(|e| ExportError::file(path, format!("written file does not read back: {e:?}")))?;
    for p in &ckpt.params {
        let view = parsed
            .tensor(&p.name)
            .map_err(|e| ExportError::tensor(path, &p.name, format!("not written: {e:?}")))?;
        if view.dtype() != dtype || view.shape() != p.shape.as_slice() {
            return Err(ExportError::tensor(
                path,
                &p.name,
                format!("written as {:?} {:?}", view.dtype(), view.shape()),
            ));
        }
    }
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), ExportError> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| ExportError::file(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| ExportError::file(path, e.to_string()))
}

/// Renames `tmp` to `out`, moving an earlier export aside first and dropping it after.
fn move_into_place(tmp: &Path, out: &Path, parent: &Path, name: &str) -> Result<(), ExportError> {
    if !out.exists() {
        return std::fs::rename(tmp, out).map_err(|e| ExportError::file(out, e.to_string()));
    }
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| ExportError::file(&old, e.to_string()))?;
    }
    std::fs::rename(out, &old).map_err(|e| ExportError::file(out, e.to_string()))?;
    if let Err(e) = std::fs::rename(tmp, out) {
        // Put the earlier export back: `out` never goes missing.
        let _ = std::fs::rename(&old, out);
        return Err(ExportError::file(out, e.to_string()));
    }
    std::fs::remove_dir_all(&old).map_err(|e| ExportError::file(&old, e.to_string()))
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "float32",
    }
}

/// One exported tensor, produced only when the writer reaches it (one tensor of host
/// memory at a time): the weights as saved, converted, or the masters from the shards.
struct OutTensor<'a> {
    ckpt: &'a Checkpoint,
    index: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    from_masters: bool,
}

impl View for OutTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let (bytes, from) = if self.from_masters {
            (self.ckpt.master_bytes(self.index), Dtype::F32)
        } else {
            (
                Cow::Borrowed(self.ckpt.weight_bytes(self.index)),
                self.ckpt.params[self.index].dtype,
            )
        };
        // A failed conversion writes nothing for this tensor; `check_written` then
        // finds the file short and the export fails, naming it.
        let converted = match convert(&bytes, from, self.dtype) {
            Ok(Cow::Borrowed(_)) => None,
            Ok(Cow::Owned(v)) => Some(v),
            Err(_) => Some(Vec::new()),
        };
        match converted {
            None => bytes,
            Some(v) => Cow::Owned(v),
        }
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}
