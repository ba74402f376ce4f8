//! CUDA streams beside libtorch's: a side stream whose work (NCCL collectives) overlaps
//! the compute queued on libtorch's current stream, ordered with it by events alone, so
//! the host never waits. Through the driver API, as the shim's other CUDA calls (no link
//! to libcudart).
//!
//! The pattern (ZeRO-3's layer prefetch): record an event on the compute stream once a
//! collective's input is ready, make the side stream wait on it, queue the collective on
//! the side stream, record an event there, and make the compute stream wait on that
//! event before it reads the output. Memory that the side stream touches must be
//! allocated on the compute stream before and freed only after the compute stream has
//! waited: libtorch's caching allocator only orders reuse within the allocating stream.

use std::ffi::{c_int, c_void};

use crate::{check, last_error, CudaError, CudaEvent};

extern "C" {
    fn manta_stream_create(device: c_int, high_priority: c_int, out: *mut *mut c_void) -> c_int;
    fn manta_stream_destroy(device: c_int, stream: *mut c_void);
    fn manta_stream_wait_event(device: c_int, stream: *mut c_void, event: *mut c_void) -> c_int;
    fn manta_stream_synchronize(device: c_int, stream: *mut c_void) -> c_int;
    fn manta_event_record_on(device: c_int, stream: *mut c_void, out: *mut *mut c_void) -> c_int;
    fn manta_with_current_stream(
        device: c_int,
        stream: *mut c_void,
        f: extern "C" fn(*mut c_void),
        data: *mut c_void,
    ) -> c_int;
}

/// A stream of one CUDA device: libtorch's current one ([`CudaStream::current`],
/// borrowed) or one this process made ([`CudaStream::new`], destroyed on drop; the work
/// queued on it still runs).
pub struct CudaStream {
    raw: *mut c_void,
    device: usize,
    owned: bool,
}

// SAFETY: a CUDA stream may be used and destroyed from any thread.
unsafe impl Send for CudaStream {}

impl CudaStream {
    /// A new stream on `device` that does not wait for libtorch's default stream (only
    /// events order it); `high_priority`: the device's highest priority, so its kernels
    /// (a collective's) are scheduled while compute kernels fill the GPU.
    pub fn new(device: usize, high_priority: bool) -> Result<Self, CudaError> {
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: the pointer is valid for writes; on success it holds a stream we own.
        check(unsafe {
            manta_stream_create(device as c_int, c_int::from(high_priority), &mut raw)
        })?;
        Ok(Self {
            raw,
            device,
            owned: true,
        })
    }

    /// libtorch's current stream on `device` (what its tensor ops queue on now).
    pub fn current(device: usize) -> Result<Self, CudaError> {
        Ok(Self {
            raw: crate::current_stream(device)?,
            device,
            owned: false,
        })
    }

    pub fn device(&self) -> usize {
        self.device
    }

    /// The raw `cudaStream_t` (null: the legacy default stream), for NCCL.
    pub fn raw(&self) -> *mut c_void {
        self.raw
    }

    /// An event that completes once the work queued on this stream so far has run.
    pub fn record(&self) -> Result<CudaEvent, CudaError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live stream; on success `ptr` holds a new event we own.
        check(unsafe { manta_event_record_on(self.device as c_int, self.raw, &mut ptr) })?;
        Ok(CudaEvent { ptr })
    }

    /// Makes the work queued on this stream from now on wait until `event` completes;
    /// the host does not wait. The event may be freed right after.
    pub fn wait(&self, event: &CudaEvent) -> Result<(), CudaError> {
        // SAFETY: a live stream and a live event.
        check(unsafe { manta_stream_wait_event(self.device as c_int, self.raw, event.ptr) })
    }

    /// Blocks the host until the work queued on this stream has run.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: a live stream.
        check(unsafe { manta_stream_synchronize(self.device as c_int, self.raw) })
    }

    /// Runs `f` with this stream as libtorch's current stream on its device (tensor ops
    /// queue here, tensors allocated belong to it), then restores the previous one. A
    /// panic in `f` is carried out after the stream is restored.
    pub fn with_current<T, F: FnOnce() -> T>(&self, f: F) -> Result<T, CudaError> {
        struct Call<F, T> {
            f: Option<F>,
            out: Option<std::thread::Result<T>>,
        }
        extern "C" fn trampoline<F: FnOnce() -> T, T>(data: *mut c_void) {
            // SAFETY: `data` is the `Call` below, alive and exclusively ours for the call.
            let call = unsafe { &mut *(data as *mut Call<F, T>) };
            if let Some(f) = call.f.take() {
                // No unwinding across the C++ frame: the panic is carried back instead.
                call.out = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
            }
        }
        let mut call = Call::<F, T> {
            f: Some(f),
            out: None,
        };
        // SAFETY: the trampoline matches `Call<F, T>`, which outlives the call.
        let rc = unsafe {
            manta_with_current_stream(
                self.device as c_int,
                self.raw,
                trampoline::<F, T>,
                &mut call as *mut Call<F, T> as *mut c_void,
            )
        };
        if rc != 0 {
            return Err(last_error());
        }
        match call.out {
            Some(Ok(out)) => Ok(out),
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Err(CudaError("the stream's closure did not run".into())),
        }
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: a stream of manta_stream_create, destroyed once.
            unsafe { manta_stream_destroy(self.device as c_int, self.raw) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    /// Without the shim's CUDA (or a device) a stream is a clear error, not a crash.
    #[test]
    fn a_stream_without_a_device_is_an_error() {
        if crate::test_gpu().is_some() {
            eprintln!("skipped: this machine has a CUDA device (the GPU test below runs)");
            return;
        }
        let err = CudaStream::new(0, true)
            .err()
            .expect("no stream without a GPU");
        assert!(!err.to_string().is_empty());
    }

    /// Work on a side stream, ordered by events only, sees the compute stream's result
    /// and is seen by it: a slow chain of matmuls on the compute stream, a copy of its
    /// result on the side stream after waiting for it, read back on the compute stream
    /// after waiting for the side stream. Without the waits the copy would read the
    /// output before the chain wrote it.
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn events_order_a_side_stream_with_the_compute_stream() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        let side = CudaStream::new(gpu, true).expect("side stream");
        let compute = CudaStream::current(gpu).expect("current stream");
        assert_ne!(side.raw(), compute.raw());
        assert_eq!(side.device(), gpu);
        for round in 0..3 {
            let a = Tensor::randn([2048, 2048], (Kind::Float, dev)) / 2048f64.sqrt();
            // Queued, not run: the host goes on at once.
            let mut x = a.shallow_clone();
            for _ in 0..20 {
                x = x.matmul(&a);
            }
            let out = Tensor::zeros([2048, 2048], (Kind::Float, dev));
            side.wait(&compute.record().expect("record")).expect("wait");
            side.with_current(|| {
                let mut o = out.shallow_clone();
                o.copy_(&x);
            })
            .expect("on the side stream");
            compute.wait(&side.record().expect("record")).expect("wait");
            assert!(
                out.equal(&x),
                "round {round}: the side copy raced the chain"
            );
        }
        side.synchronize().expect("synchronize");
    }
}
