//! Weights as bytes on the wire: a trainer's tensors become a [`WeightSet`] (raw
//! little-endian bytes per tensor, with a CRC-32C), sent as a stream of bounded
//! [`WeightChunk`]s and put back together by an [`Assembler`] that checks every size
//! and checksum. This is how weights reach engines in other processes without a
//! shared disk (and without one giant gRPC message).

use std::sync::Arc;

use manta_proto::weight_sync as wpb;
use manta_proto::weight_sync::weight_chunk::Part;
use manta_trainer::NamedTensors;
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

pub use wpb::WeightChunk;

/// Default bytes of tensor data per chunk (far under tonic's 4 MiB message limit).
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// Largest weight-sync message either side accepts.
pub const MAX_WEIGHT_MESSAGE: usize = 16 << 20;
/// Environment variable overriding [`DEFAULT_CHUNK_BYTES`] (tests use small chunks).
pub const CHUNK_ENV: &str = manta_knobs::WEIGHT_CHUNK_BYTES;

/// What can be wrong with weights on the wire.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("weight stream: {0}")]
    Protocol(String),
    #[error("tensor {name}: CRC-32C {got:08x} does not match the sender's {want:08x}")]
    Checksum { name: String, got: u32, want: u32 },
    #[error("tensor {name}: dtype {dtype} is not supported on the wire")]
    Dtype { name: String, dtype: String },
    #[error("tensor {name}: {message}")]
    Tensor { name: String, message: String },
    #[error("{CHUNK_ENV}={value}: {message}")]
    ChunkSize { value: String, message: String },
}

/// The chunk size to send with: [`CHUNK_ENV`] when set (1 byte ..= a quarter of
/// [`MAX_WEIGHT_MESSAGE`]), else [`DEFAULT_CHUNK_BYTES`].
pub fn chunk_bytes() -> Result<usize, WeightsError> {
    let n = match manta_knobs::weight_chunk_bytes() {
        Err(e) => {
            return Err(WeightsError::ChunkSize {
                value: e.value,
                message: e.expected,
            })
        }
        Ok(None) => return Ok(DEFAULT_CHUNK_BYTES),
        Ok(Some(n)) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let bad = |message: &str| WeightsError::ChunkSize {
        value: n.to_string(),
        message: message.to_string(),
    };
    if n == 0 || n > MAX_WEIGHT_MESSAGE / 4 {
        return Err(bad(&format!(
            "must be between 1 and {} bytes",
            MAX_WEIGHT_MESSAGE / 4
        )));
    }
    Ok(n)
}

/// One tensor as bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorBytes {
    pub name: String,
    /// safetensors dtype name (F32, BF16, ...).
    pub dtype: String,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

/// A whole model's weights as bytes, in a fixed tensor order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightSet {
    pub tensors: Vec<TensorBytes>,
}

fn dtype_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Float => "F32",
        Kind::BFloat16 => "BF16",
        Kind::Half => "F16",
        Kind::Double => "F64",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        _ => return None,
    })
}

fn dtype_kind(name: &str) -> Option<Kind> {
    Some(match name {
        "F32" => Kind::Float,
        "BF16" => Kind::BFloat16,
        "F16" => Kind::Half,
        "F64" => Kind::Double,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

/// A tensor's bytes as stored (contiguous, on the CPU).
pub fn tensor_bytes(name: &str, t: &Tensor) -> Result<TensorBytes, WeightsError> {
    let kind = t.kind();
    let dtype = dtype_name(kind).ok_or_else(|| WeightsError::Dtype {
        name: name.to_string(),
        dtype: format!("{kind:?}"),
    })?;
    let cpu = t.to_device(Device::Cpu).contiguous();
    let numel = cpu.numel();
    let mut data = vec![0u8; numel * kind.elt_size_in_bytes()];
    cpu.f_copy_data_u8(&mut data, numel)
        .map_err(|e| WeightsError::Tensor {
            name: name.to_string(),
            message: e.to_string(),
        })?;
    Ok(TensorBytes {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape: cpu.size(),
        data,
    })
}

impl WeightSet {
    /// Copies `tensors` to bytes (any device; names keep their order).
    pub fn from_tensors(tensors: &NamedTensors) -> Result<Self, WeightsError> {
        let tensors = tensors
            .iter()
            .map(|(n, t)| tensor_bytes(n, t))
            .collect::<Result<_, _>>()?;
        Ok(Self { tensors })
    }

    /// CPU tensors with the same names, dtypes, shapes and bytes.
    pub fn to_tensors(&self) -> Result<NamedTensors, WeightsError> {
        self.tensors
            .iter()
            .map(|t| {
                let err = |message: String| WeightsError::Tensor {
                    name: t.name.clone(),
                    message,
                };
                let kind = dtype_kind(&t.dtype).ok_or_else(|| WeightsError::Dtype {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                })?;
                let numel: i64 = t.shape.iter().product();
                if numel < 0 || numel as usize * kind.elt_size_in_bytes() != t.data.len() {
                    return Err(err(format!(
                        "{} bytes do not make a {} tensor of shape {:?}",
                        t.data.len(),
                        t.dtype,
                        t.shape
                    )));
                }
                let tensor = Tensor::f_from_data_size(&t.data, &t.shape, kind)
                    .map_err(|e| err(e.to_string()))?;
                Ok((t.name.clone(), tensor))
            })
            .collect()
    }

    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// SHA-256 of each tensor's bytes.
    pub fn digests(&self) -> Vec<wpb::TensorDigest> {
        self.tensors
            .iter()
            .map(|t| wpb::TensorDigest {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                sha256: hex::encode(Sha256::digest(&t.data)),
            })
            .collect()
    }

    /// The stream that carries this set as `version`: a begin message, then each
    /// tensor's header and its data in chunks of at most `chunk_bytes`.
    pub fn chunks(
        self: Arc<Self>,
        version: u64,
        chunk_bytes: usize,
    ) -> impl Iterator<Item = WeightChunk> + Send + 'static {
        let chunk_bytes = chunk_bytes.max(1);
        let begin = WeightChunk {
            part: Some(Part::Begin(wpb::WeightsBegin {
                version,
                tensors: self.tensors.len() as u32,
                bytes: self.bytes(),
            })),
        };
        let set = self.clone();
        let per_tensor = (0..self.tensors.len()).flat_map(move |i| {
            let t = &set.tensors[i];
            let header = WeightChunk {
                part: Some(Part::Tensor(wpb::TensorHeader {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape: t.shape.clone(),
                    nbytes: t.data.len() as u64,
                    crc32c: crc32c::crc32c(&t.data),
                })),
            };
            let set = set.clone();
            let n = t.data.len().div_ceil(chunk_bytes);
            std::iter::once(header).chain((0..n).map(move |k| {
                let data = &set.tensors[i].data;
                let end = ((k + 1) * chunk_bytes).min(data.len());
                WeightChunk {
                    part: Some(Part::Data(data[k * chunk_bytes..end].to_vec())),
                }
            }))
        });
        std::iter::once(begin).chain(per_tensor)
    }
}

/// Puts a chunk stream back together, checking order, sizes and checksums.
#[derive(Debug, Default)]
pub struct Assembler {
    begin: Option<wpb::WeightsBegin>,
    set: WeightSet,
    /// The tensor being filled and its expected size and checksum.
    open: Option<(usize, u32)>,
}

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next message of the stream.
    pub fn push(&mut self, chunk: WeightChunk) -> Result<(), WeightsError> {
        let proto = |m: String| WeightsError::Protocol(m);
        match chunk.part {
            None => Err(proto("a chunk with no part".into())),
            Some(Part::Begin(b)) => {
                if self.begin.is_some() {
                    return Err(proto("a second begin message".into()));
                }
                self.begin = Some(b);
                Ok(())
            }
            Some(_) if self.begin.is_none() => Err(proto("data before the begin message".into())),
            Some(Part::Tensor(h)) => {
                self.close_tensor()?;
                if dtype_kind(&h.dtype).is_none() {
                    return Err(WeightsError::Dtype {
                        name: h.name,
                        dtype: h.dtype,
                    });
                }
                let nbytes = usize::try_from(h.nbytes)
                    .map_err(|_| proto(format!("tensor {}: {} bytes", h.name, h.nbytes)))?;
                self.open = Some((nbytes, h.crc32c));
                self.set.tensors.push(TensorBytes {
                    name: h.name,
                    dtype: h.dtype,
                    shape: h.shape,
                    data: Vec::with_capacity(nbytes),
                });
                Ok(())
            }
            Some(Part::Data(bytes)) => {
                let (want, _) = self
                    .open
                    .ok_or_else(|| proto("data before a tensor header".into()))?;
                let t = self
                    .set
                    .tensors
                    .last_mut()
                    .ok_or_else(|| proto("data before a tensor header".into()))?;
                if t.data.len() + bytes.len() > want {
                    return Err(proto(format!(
                        "tensor {}: more than its {want} bytes arrived",
                        t.name
                    )));
                }
                t.data.extend_from_slice(&bytes);
                Ok(())
            }
        }
    }

    fn close_tensor(&mut self) -> Result<(), WeightsError> {
        let Some((want, crc)) = self.open.take() else {
            return Ok(());
        };
        let t = self
            .set
            .tensors
            .last()
            .ok_or_else(|| WeightsError::Protocol("no tensor is open".into()))?;
        if t.data.len() != want {
            return Err(WeightsError::Protocol(format!(
                "tensor {}: {} of its {want} bytes arrived",
                t.name,
                t.data.len()
            )));
        }
        let got = crc32c::crc32c(&t.data);
        if got != crc {
            return Err(WeightsError::Checksum {
                name: t.name.clone(),
                got,
                want: crc,
            });
        }
        Ok(())
    }

    /// The version and the whole set, once the stream ended.
    pub fn finish(mut self) -> Result<(u64, WeightSet), WeightsError> {
        self.close_tensor()?;
        let begin = self
            .begin
            .ok_or_else(|| WeightsError::Protocol("the stream was empty".into()))?;
        if begin.tensors as usize != self.set.tensors.len() || begin.bytes != self.set.bytes() {
            return Err(WeightsError::Protocol(format!(
                "{} tensors ({} bytes) arrived of {} ({} bytes) announced",
                self.set.tensors.len(),
                self.set.bytes(),
                begin.tensors,
                begin.bytes
            )));
        }
        Ok((begin.version, self.set))
    }
}

/// SHA-256 of each tensor's bytes (as [`WeightSet::digests`], straight from tensors).
///
/// Tensors are hashed on several threads, one tensor at a time each; a GPU tensor goes to
/// the host in pieces through the thread's pinned buffer and is hashed piece by piece.
/// Whole pageable copies on one thread moved an 8B model's 16 GB at about 1.4 GB/s (11 s
/// a side, every sync), which made checking every sync of a long run impractical.
pub fn digest_tensors(tensors: &NamedTensors) -> Result<Vec<wpb::TensorDigest>, WeightsError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16)
        .min(tensors.len().max(1));
    // Tensors are not `Sync`: each thread takes shallow clones (`Send`) off one queue.
    let queue = std::sync::Mutex::new(
        tensors
            .iter()
            .enumerate()
            .rev()
            .map(|(i, (n, t))| (i, n.clone(), t.shallow_clone()))
            .collect::<Vec<_>>(),
    );
    let mut digests: Vec<Option<wpb::TensorDigest>> = vec![None; tensors.len()];
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    let mut staging = None;
                    loop {
                        let next = queue.lock().ok().and_then(|mut q| q.pop());
                        let Some((i, name, t)) = next else {
                            return Ok(mine);
                        };
                        mine.push((i, digest_tensor(&name, &t, &mut staging)?));
                    }
                })
            })
            .collect();
        for worker in workers {
            let mine = worker.join().map_err(|_| WeightsError::Tensor {
                name: "(a weight digest)".into(),
                message: "the hashing thread panicked".into(),
            })??;
            for (i, d) in mine {
                digests[i] = Some(d);
            }
        }
        Ok::<_, WeightsError>(())
    })?;
    Ok(digests.into_iter().flatten().collect())
}

/// Bytes of a GPU tensor copied to the host at once for hashing.
const STAGING_BYTES: i64 = 64 << 20;

/// One tensor's digest. `staging`: this thread's pinned host buffer, made at its first
/// GPU tensor.
fn digest_tensor(
    name: &str,
    t: &Tensor,
    staging: &mut Option<Tensor>,
) -> Result<wpb::TensorDigest, WeightsError> {
    let kind = t.kind();
    let dtype = dtype_name(kind).ok_or_else(|| WeightsError::Dtype {
        name: name.to_string(),
        dtype: format!("{kind:?}"),
    })?;
    let failed = |e: tch::TchError| WeightsError::Tensor {
        name: name.to_string(),
        message: e.to_string(),
    };
    let dense = t.contiguous();
    let len = (dense.numel() * kind.elt_size_in_bytes()) as i64;
    let mut sha = Sha256::new();
    if len > 0 {
        if dense.device() == Device::Cpu {
            sha.update(host_bytes(&dense, len));
        } else {
            let bytes = dense
                .f_view_dtype(Kind::Uint8)
                .map_err(failed)?
                .f_view([len])
                .map_err(failed)?;
            let buffer = match staging {
                Some(b) => b,
                None => staging.insert(
                    Tensor::f_empty([STAGING_BYTES], (Kind::Uint8, Device::Cpu))
                        .and_then(|b| b.f_pin_memory(dense.device()))
                        .map_err(failed)?,
                ),
            };
            let mut at = 0;
            while at < len {
                let n = (len - at).min(STAGING_BYTES);
                let mut piece = buffer.narrow(0, 0, n);
                piece.f_copy_(&bytes.narrow(0, at, n)).map_err(failed)?;
                sha.update(host_bytes(&piece, n));
                at += n;
            }
        }
    }
    Ok(wpb::TensorDigest {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape: dense.size(),
        sha256: hex::encode(sha.finalize()),
    })
}

/// The first `len` bytes of dense host tensor `t`, which must hold at least that many.
fn host_bytes(t: &Tensor, len: i64) -> &[u8] {
    // SAFETY: callers pass a dense host tensor of at least `len` bytes; the slice is only
    // read while `t` lives.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_set() -> NamedTensors {
        tch::manual_seed(3);
        vec![
            // 3.5 chunks of 4 KiB.
            (
                "a.weight".into(),
                Tensor::randn([14 * 256], (Kind::Float, Device::Cpu)),
            ),
            (
                "b.weight".into(),
                Tensor::randn([7, 9], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
            ),
            (
                "empty".into(),
                Tensor::zeros([0], (Kind::Float, Device::Cpu)),
            ),
        ]
    }

    #[test]
    fn chunks_are_bounded_and_reassemble_bit_for_bit() {
        let tensors = sample_set();
        let set = Arc::new(WeightSet::from_tensors(&tensors).unwrap());
        let chunks: Vec<WeightChunk> = set.clone().chunks(7, 4096).collect();
        let data: Vec<usize> = chunks
            .iter()
            .filter_map(|c| match &c.part {
                Some(Part::Data(d)) => Some(d.len()),
                _ => None,
            })
            .collect();
        assert_eq!(data, vec![4096, 4096, 4096, 2048, 7 * 9 * 2]);
        let mut asm = Assembler::new();
        for c in chunks {
            asm.push(c).unwrap();
        }
        let (version, back) = asm.finish().unwrap();
        assert_eq!(version, 7);
        assert_eq!(&back, set.as_ref());
        for ((n0, t0), (n1, t1)) in tensors.iter().zip(back.to_tensors().unwrap()) {
            assert_eq!(n0, &n1);
            assert_eq!(t0.kind(), t1.kind());
            assert_eq!(t0.size(), t1.size());
            // Bit for bit, not approximately (NaN-safe: compares the bytes).
            assert_eq!(
                tensor_bytes(n0, t0).unwrap().data,
                tensor_bytes(&n1, &t1).unwrap().data
            );
        }
    }

    #[test]
    fn parallel_digests_match_the_byte_sets_in_order_and_name_a_bad_dtype() {
        // More tensors than hashing threads, one of them a transposed (strided) view.
        let mut tensors = sample_set();
        for i in 0..40 {
            tensors.push((
                format!("layer.{i}"),
                Tensor::randn([5 + i, 3], (Kind::Float, Device::Cpu)).tr(),
            ));
        }
        let want = WeightSet::from_tensors(&tensors).unwrap().digests();
        assert_eq!(digest_tensors(&tensors).unwrap(), want);
        // One changed element changes that tensor's digest only.
        let _ = tensors[5].1.get(0).get(0).fill_(7.0);
        let changed = digest_tensors(&tensors).unwrap();
        let differ: Vec<&str> = changed
            .iter()
            .zip(&want)
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.name.as_str())
            .collect();
        assert_eq!(differ, vec!["layer.2"]);
        tensors.push((
            "complex".into(),
            Tensor::zeros([2], (Kind::ComplexFloat, Device::Cpu)),
        ));
        let err = digest_tensors(&tensors).unwrap_err().to_string();
        assert!(err.contains("complex"), "{err}");
    }

    /// GPU tensors are hashed through pinned pieces of [`STAGING_BYTES`]: their digests
    /// must be those of the same bytes hashed on the host, for a tensor of several pieces
    /// and a partial last one, and a change in the last piece must show.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn gpu_tensors_digest_as_their_host_copies() {
        let Some(gpu) = manta_cuda::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        tch::manual_seed(5);
        let pieces = 2 * STAGING_BYTES / 2 + 12_345; // bf16 elements: two pieces and a bit
        let gpu_set: NamedTensors = vec![
            (
                "big".into(),
                Tensor::randn([pieces], (Kind::Float, Device::Cuda(gpu))).to_kind(Kind::BFloat16),
            ),
            (
                "small".into(),
                Tensor::randn([3, 5], (Kind::Float, Device::Cuda(gpu))).tr(),
            ),
        ];
        let host: NamedTensors = gpu_set
            .iter()
            .map(|(n, t)| (n.clone(), t.to_device(Device::Cpu)))
            .collect();
        let want = WeightSet::from_tensors(&host).unwrap().digests();
        assert_eq!(digest_tensors(&gpu_set).unwrap(), want);
        let _ = gpu_set[0].1.narrow(0, pieces - 1, 1).fill_(3.0);
        let changed = digest_tensors(&gpu_set).unwrap();
        assert_ne!(changed[0], want[0]);
        assert_eq!(changed[1], want[1]);
    }

    #[test]
    fn a_corrupted_or_short_stream_is_refused_naming_the_tensor() {
        let set = Arc::new(WeightSet::from_tensors(&sample_set()).unwrap());
        let mut chunks: Vec<WeightChunk> = set.clone().chunks(1, 4096).collect();
        if let Some(Part::Data(d)) = &mut chunks[2].part {
            d[10] ^= 1;
        }
        let mut asm = Assembler::new();
        let err = chunks
            .into_iter()
            .try_for_each(|c| asm.push(c))
            .and_then(|()| asm.finish().map(|_| ()))
            .unwrap_err();
        assert!(
            matches!(&err, WeightsError::Checksum { name, .. } if name == "a.weight"),
            "{err}"
        );

        let mut short: Vec<WeightChunk> = set.chunks(1, 4096).collect();
        short.remove(3);
        let mut asm = Assembler::new();
        let err = short
            .into_iter()
            .try_for_each(|c| asm.push(c))
            .and_then(|()| asm.finish().map(|_| ()))
            .unwrap_err();
        assert!(err.to_string().contains("tensor a.weight"), "{err}");
    }
}
