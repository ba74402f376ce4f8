//! torch.distributed's `TCPStore`, through libtorch's own implementation (rendezvous.cpp):
//! the key-value store that `init_process_group(init_method="tcp://host:port")` and
//! SGLang's `init_weights_update_group` meet at. A Manta trainer hosts it (as rank 0 of
//! a weight-update group) or joins one, and Python peers see exactly torch's protocol.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Duration;

extern "C" {
    fn manta_store_last_error() -> *const c_char;
    fn manta_tcp_store_new(
        host: *const c_char,
        port: c_int,
        is_server: c_int,
        world_size: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    fn manta_tcp_store_port(handle: *mut c_void) -> c_int;
    fn manta_tcp_store_set(
        handle: *mut c_void,
        key: *const c_char,
        data: *const u8,
        len: usize,
    ) -> c_int;
    fn manta_tcp_store_get(
        handle: *mut c_void,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> c_int;
    fn manta_tcp_store_add(
        handle: *mut c_void,
        key: *const c_char,
        delta: i64,
        out: *mut i64,
    ) -> c_int;
    fn manta_tcp_store_check(handle: *mut c_void, key: *const c_char, out: *mut c_int) -> c_int;
    fn manta_tcp_store_delete(handle: *mut c_void, key: *const c_char) -> c_int;
    fn manta_store_free_bytes(data: *mut u8);
    fn manta_tcp_store_free(handle: *mut c_void);
}

/// A store operation that failed, with libtorch's message (timeouts, refused connections,
/// a peer that closed the store).
#[derive(Debug, Clone, thiserror::Error)]
#[error("TCPStore {op}: {message}")]
pub struct StoreError {
    pub op: &'static str,
    pub message: String,
}

fn check(op: &'static str, rc: c_int) -> Result<(), StoreError> {
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer to a thread-local, NUL-terminated string.
    let message = unsafe { CStr::from_ptr(manta_store_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(StoreError { op, message })
}

fn c_string(op: &'static str, s: &str) -> Result<CString, StoreError> {
    CString::new(s).map_err(|_| StoreError {
        op,
        message: format!("{s:?} contains a NUL byte"),
    })
}

/// A member's connection to a `TCPStore` (the host's own included).
pub struct TcpStore {
    handle: *mut c_void,
}

// SAFETY: c10d::TCPStore serialises its operations internally (one client socket behind
// a lock); the handle is owned by this value and freed once.
unsafe impl Send for TcpStore {}
// SAFETY: as for Send: the store's own lock serialises calls from several threads.
unsafe impl Sync for TcpStore {}

impl TcpStore {
    /// Hosts a store on `port` of every interface (0: any free port, see
    /// [`TcpStore::port`]) for `world_size` members in all, this one included (its own
    /// connection goes through the loopback). `timeout` bounds every wait.
    pub fn host(port: u16, world_size: usize, timeout: Duration) -> Result<Self, StoreError> {
        Self::open("host", "127.0.0.1", port, true, world_size, timeout)
    }

    /// Joins the store hosted at `host:port`, retrying the connection until `timeout`.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, StoreError> {
        Self::open("connect", host, port, false, 0, timeout)
    }

    fn open(
        op: &'static str,
        host: &str,
        port: u16,
        is_server: bool,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let host = c_string(op, host)?;
        let world = c_int::try_from(world_size).map_err(|_| StoreError {
            op,
            message: format!("world size {world_size} is too large"),
        })?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointer for the call.
        check(op, unsafe {
            manta_tcp_store_new(
                host.as_ptr(),
                c_int::from(port),
                c_int::from(is_server),
                world,
                timeout.as_millis().min(i64::MAX as u128) as i64,
                &mut handle,
            )
        })?;
        Ok(Self { handle })
    }

    /// The port the store listens on (the one chosen when hosting on port 0).
    pub fn port(&self) -> u16 {
        // SAFETY: a live handle.
        unsafe { manta_tcp_store_port(self.handle) }.clamp(0, c_int::from(u16::MAX)) as u16
    }

    /// Sets `key` to `value` for every member.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = c_string("set", key)?;
        // SAFETY: a live handle, a C string and a byte slice valid for the call.
        check("set", unsafe {
            manta_tcp_store_set(self.handle, key.as_ptr(), value.as_ptr(), value.len())
        })
    }

    /// The value of `key`, waiting (up to the store's timeout) until a member sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let c_key = c_string("get", key)?;
        let (mut data, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a live handle, a C string and out-pointers valid for the call.
        check("get", unsafe {
            manta_tcp_store_get(self.handle, c_key.as_ptr(), &mut data, &mut len)
        })
        .map_err(|e| StoreError {
            message: format!("{key:?}: {}", e.message),
            ..e
        })?;
        // SAFETY: the shim malloc'ed `len` bytes at `data` (at least one byte), freed here.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        // SAFETY: `data` came from the shim's malloc above and is not used after this.
        unsafe { manta_store_free_bytes(data) };
        Ok(value)
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let key = c_string("add", key)?;
        let mut out = 0i64;
        // SAFETY: a live handle, a C string and an out-pointer valid for the call.
        check("add", unsafe {
            manta_tcp_store_add(self.handle, key.as_ptr(), delta, &mut out)
        })?;
        Ok(out)
    }

    /// Whether `key` is set, without waiting: a member that must be able to give up a
    /// wait (its group aborted) polls this instead of blocking in [`TcpStore::get`].
    pub fn check(&self, key: &str) -> Result<bool, StoreError> {
        let key = c_string("check", key)?;
        let mut out: c_int = 0;
        // SAFETY: a live handle, a C string and an out-pointer valid for the call.
        check("check", unsafe {
            manta_tcp_store_check(self.handle, key.as_ptr(), &mut out)
        })?;
        Ok(out != 0)
    }

    /// Removes `key` for every member (nothing happens when it is unset): a member that
    /// streams values through the store deletes those every peer has read, so the
    /// host's memory stays bounded.
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let key = c_string("delete", key)?;
        // SAFETY: a live handle and a C string valid for the call.
        check("delete", unsafe {
            manta_tcp_store_delete(self.handle, key.as_ptr())
        })
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // SAFETY: the handle came from manta_tcp_store_new and is freed once.
        unsafe { manta_tcp_store_free(self.handle) };
    }
}
