//! The weight-update group whatever the device: NCCL between GPUs
//! ([`crate::process_group`]), or torch's `TCPStore` ([`crate::rendezvous`]) for members
//! whose tensors are on the CPU. Both keep one protocol: rank 0 hosts the store at
//! `master_address` (port 0: any free port, [`WeightGroup::store_port`]), the others join
//! with that port, and a broadcast from rank 0 fills every member's tensors in one fixed
//! order. So the code around the group — who makes it, how members learn the address,
//! how a broken group is aborted and rebuilt — runs the same on a machine without GPUs.
//!
//! The store backend moves the bytes through rank 0's store: each tensor under its index,
//! then a `ready` key for the round; members read them into their tensors and count
//! themselves done, and rank 0 returns once every member has. Each round overwrites the
//! last, so the store holds one copy of the weights. Meant for CPU members and tests: it
//! is not a fast path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use crate::process_group::{Aborter, GroupError, GroupSpec, ProcessGroup};
use crate::rendezvous::TcpStore;

/// A group name no other group of this host uses: `prefix`, the process id, the time
/// and a per-process count.
pub fn unique_name(prefix: &str) -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{nanos}-{n}", std::process::id())
}

/// How the group moves tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NCCL broadcasts between CUDA devices (`spec.device` is this member's GPU).
    Nccl,
    /// Bytes through rank 0's `TCPStore`, for CPU tensors (`spec.device` is unused).
    Store,
}

/// One member of a weight-update group.
pub enum WeightGroup {
    Nccl(ProcessGroup),
    Store(StoreGroup),
}

/// Ends a group's collectives from any thread (see [`WeightGroup::aborter`]).
pub enum GroupAborter {
    Nccl(Aborter),
    Store(Arc<AtomicBool>),
}

impl GroupAborter {
    /// Aborts the group: collectives in flight return with an error, later ones fail.
    pub fn abort(&self) -> Result<(), GroupError> {
        match self {
            GroupAborter::Nccl(a) => a.abort(),
            GroupAborter::Store(flag) => {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }
        }
    }
}

impl WeightGroup {
    /// Joins (rank 0: hosts) the group `spec` describes over `backend`.
    pub fn join(spec: GroupSpec, backend: Backend) -> Result<Self, GroupError> {
        match backend {
            Backend::Nccl => ProcessGroup::join(spec).map(WeightGroup::Nccl),
            Backend::Store => StoreGroup::join(spec).map(WeightGroup::Store),
        }
    }

    pub fn backend(&self) -> Backend {
        match self {
            WeightGroup::Nccl(_) => Backend::Nccl,
            WeightGroup::Store(_) => Backend::Store,
        }
    }

    pub fn spec(&self) -> &GroupSpec {
        match self {
            WeightGroup::Nccl(g) => g.spec(),
            WeightGroup::Store(g) => &g.spec,
        }
    }

    /// The port rank 0's store listens on (what the other members join with).
    pub fn store_port(&self) -> u16 {
        match self {
            WeightGroup::Nccl(g) => g.store_port(),
            WeightGroup::Store(g) => g.store.port(),
        }
    }

    /// Broadcasts `tensors` from rank `src` in order: see [`ProcessGroup::broadcast`].
    pub fn broadcast(
        &mut self,
        tensors: &[(String, Tensor)],
        src: usize,
    ) -> Result<(), GroupError> {
        match self {
            WeightGroup::Nccl(g) => g.broadcast(tensors, src),
            WeightGroup::Store(g) => g.broadcast(tensors, src),
        }
    }

    /// NCCL: how long the last broadcast took to issue its collectives on the host
    /// ([`ProcessGroup::last_enqueue`]); `None` for the store backend.
    pub fn last_enqueue(&self) -> Option<Duration> {
        match self {
            WeightGroup::Nccl(g) => Some(g.last_enqueue()),
            WeightGroup::Store(_) => None,
        }
    }

    pub fn aborter(&self) -> GroupAborter {
        match self {
            WeightGroup::Nccl(g) => GroupAborter::Nccl(g.aborter()),
            WeightGroup::Store(g) => GroupAborter::Store(g.aborted.clone()),
        }
    }
}

/// A member of a group whose broadcasts go through rank 0's `TCPStore`.
pub struct StoreGroup {
    spec: GroupSpec,
    store: TcpStore,
    /// Broadcasts so far: every member counts the same rounds.
    round: u64,
    aborted: Arc<AtomicBool>,
}

fn error(op: &'static str, message: impl Into<String>) -> GroupError {
    GroupError {
        op,
        message: message.into(),
    }
}

impl StoreGroup {
    /// Rank 0 hosts the store and returns at once; the others connect to it (retrying
    /// until the spec's timeout).
    pub fn join(spec: GroupSpec) -> Result<Self, GroupError> {
        spec.validate()?;
        let store = if spec.rank == 0 {
            TcpStore::host(spec.master_port, spec.world_size, spec.timeout)
        } else {
            TcpStore::connect(&spec.master_address, spec.master_port, spec.timeout)
        }
        .map_err(|e| error("join", format!("group {:?}: {e}", spec.group_name)))?;
        Ok(Self {
            spec,
            store,
            round: 0,
            aborted: Arc::new(AtomicBool::new(false)),
        })
    }

    fn key(&self, what: &str) -> String {
        format!("{}/{what}", self.spec.group_name)
    }

    fn broadcast(&mut self, tensors: &[(String, Tensor)], src: usize) -> Result<(), GroupError> {
        let fail = |m: String| {
            error(
                "broadcast",
                format!("group {:?}: {m}", self.spec.group_name),
            )
        };
        if src >= self.spec.world_size {
            return Err(fail(format!(
                "src {src} is not below world_size {}",
                self.spec.world_size
            )));
        }
        if self.aborted.load(Ordering::SeqCst) {
            return Err(fail("the group was aborted".into()));
        }
        for (name, t) in tensors {
            if t.device() != Device::Cpu || !t.is_contiguous() {
                return Err(fail(format!(
                    "tensor {name} is not a dense CPU tensor (the store backend moves host memory)"
                )));
            }
        }
        self.round += 1;
        let round = self.round;
        let ready = self.key(&format!("ready/{round}"));
        let done = self.key(&format!("done/{round}"));
        let store_err = |e: crate::rendezvous::StoreError| fail(e.to_string());
        if self.spec.rank == src {
            for (i, (_, t)) in tensors.iter().enumerate() {
                self.store
                    .set(&self.key(&format!("tensor/{i}")), bytes_of(t))
                    .map_err(store_err)?;
            }
            self.store
                .set(&ready, &round.to_le_bytes())
                .map_err(store_err)?;
            // Every other member reads this round before the next one overwrites it.
            let started = Instant::now();
            loop {
                let finished = self.store.add(&done, 0).map_err(store_err)?;
                if finished as usize >= self.spec.world_size - 1 {
                    return Ok(());
                }
                if self.aborted.load(Ordering::SeqCst) {
                    return Err(fail("the group was aborted".into()));
                }
                if started.elapsed() > self.spec.timeout {
                    return Err(fail(format!(
                        "{finished} of {} members took round {round} within {} s",
                        self.spec.world_size - 1,
                        self.spec.timeout.as_secs()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Polled, not a blocking get: an abort (rank 0's side failed) ends the wait at
        // once instead of at the store's timeout.
        let started = Instant::now();
        while !self.store.check(&ready).map_err(store_err)? {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(fail(format!(
                    "the group was aborted while waiting for round {round}"
                )));
            }
            if started.elapsed() > self.spec.timeout {
                return Err(fail(format!(
                    "rank 0 sent no round {round} within {} s",
                    self.spec.timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for (i, (name, t)) in tensors.iter().enumerate() {
            let bytes = self
                .store
                .get(&self.key(&format!("tensor/{i}")))
                .map_err(store_err)?;
            let want = t.numel() * t.kind().elt_size_in_bytes();
            if bytes.len() != want {
                return Err(fail(format!(
                    "tensor {i} ({name}): {} bytes sent, {want} expected (shapes or dtypes differ)",
                    bytes.len()
                )));
            }
            // SAFETY: `t` is a dense CPU tensor of exactly `want` bytes (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.data_ptr() as *mut u8, want);
            }
        }
        self.store.add(&done, 1).map_err(store_err)?;
        Ok(())
    }
}

/// A dense CPU tensor's memory.
fn bytes_of(t: &Tensor) -> &[u8] {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller checked `t` is dense on the CPU; the slice lives as long as `t`.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn spec(rank: usize, world: usize, port: u16, name: &str) -> GroupSpec {
        GroupSpec {
            master_address: "127.0.0.1".into(),
            master_port: port,
            rank,
            world_size: world,
            group_name: name.into(),
            device: 0,
            timeout: Duration::from_secs(20),
        }
    }

    /// Rank 0 and two members in threads: two rounds arrive bit for bit, in order, and
    /// a member whose tensor has another size is refused by name.
    #[test]
    fn a_store_group_broadcasts_rounds_to_every_member() {
        let mut root = WeightGroup::join(spec(0, 3, 0, "t-rounds"), Backend::Store).unwrap();
        let port = root.store_port();
        assert_ne!(port, 0);
        let members: Vec<_> = (1..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mut g =
                        WeightGroup::join(spec(rank, 3, port, "t-rounds"), Backend::Store).unwrap();
                    let mut got = Vec::new();
                    for _ in 0..2 {
                        let t = vec![
                            (
                                "a".to_string(),
                                Tensor::zeros([3, 4], (Kind::BFloat16, Device::Cpu)),
                            ),
                            (
                                "b".to_string(),
                                Tensor::zeros([5], (Kind::Float, Device::Cpu)),
                            ),
                        ];
                        g.broadcast(&t, 0).unwrap();
                        got.push(t);
                    }
                    got
                })
            })
            .collect();
        let mut sent = Vec::new();
        for round in 0..2 {
            tch::manual_seed(round);
            let t = vec![
                (
                    "a".to_string(),
                    Tensor::randn([3, 4], (Kind::BFloat16, Device::Cpu)),
                ),
                (
                    "b".to_string(),
                    Tensor::randn([5], (Kind::Float, Device::Cpu)),
                ),
            ];
            root.broadcast(&t, 0).unwrap();
            sent.push(t);
        }
        for m in members {
            let got = m.join().unwrap();
            for (s, g) in sent.iter().zip(&got) {
                for ((_, a), (_, b)) in s.iter().zip(g) {
                    assert!(a.equal(b), "a member holds what rank 0 sent");
                }
            }
        }
        assert!(!sent[0][0].1.equal(&sent[1][0].1), "the rounds differ");

        let mut root = WeightGroup::join(spec(0, 2, 0, "t-size"), Backend::Store).unwrap();
        let port = root.store_port();
        let member = std::thread::spawn(move || {
            let mut g = WeightGroup::join(spec(1, 2, port, "t-size"), Backend::Store).unwrap();
            let t = vec![(
                "w".to_string(),
                Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            )];
            g.broadcast(&t, 0).unwrap_err().to_string()
        });
        let aborter = root.aborter();
        let sending = std::thread::spawn(move || {
            let t = vec![(
                "w".to_string(),
                Tensor::zeros([5], (Kind::Float, Device::Cpu)),
            )];
            root.broadcast(&t, 0).unwrap_err().to_string()
        });
        let why = member.join().unwrap();
        assert!(
            why.contains("tensor 0 (w): 20 bytes sent, 16 expected"),
            "{why}"
        );
        // The root waits for a member that gave up: aborting ends its wait.
        aborter.abort().unwrap();
        let why = sending.join().unwrap();
        assert!(why.contains("aborted"), "{why}");
    }

    /// A member whose rank 0 never sends: aborting it from another thread ends its wait
    /// long before the group's timeout (a liveness bound, not a speed figure).
    #[test]
    fn an_aborted_store_member_stops_waiting_for_rank_0() {
        let mut timed = spec(0, 2, 0, "t-abort");
        timed.timeout = Duration::from_secs(60);
        let root = WeightGroup::join(timed.clone(), Backend::Store).unwrap();
        timed.rank = 1;
        timed.master_port = root.store_port();
        let mut member = WeightGroup::join(timed, Backend::Store).unwrap();
        let aborter = member.aborter();
        let started = Instant::now();
        let waiting = std::thread::spawn(move || {
            let t = vec![(
                "w".to_string(),
                Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            )];
            member.broadcast(&t, 0).unwrap_err().to_string()
        });
        std::thread::sleep(Duration::from_millis(200));
        aborter.abort().unwrap();
        let why = waiting.join().unwrap();
        assert!(why.contains("aborted") && why.contains("t-abort"), "{why}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the member waited {:?} after its abort",
            started.elapsed()
        );
        drop(root);
    }

    #[test]
    fn group_names_differ_between_groups() {
        let a = unique_name("manta-weights");
        assert_ne!(a, unique_name("manta-weights"));
        assert!(a.starts_with("manta-weights-"));
    }

    #[test]
    fn the_store_backend_moves_cpu_tensors_only() {
        let mut g = WeightGroup::join(spec(0, 1, 0, "t-dense"), Backend::Store).unwrap();
        let t = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let strided = vec![("t".to_string(), t.tr())];
        let why = g.broadcast(&strided, 0).unwrap_err().to_string();
        assert!(why.contains("tensor t is not a dense CPU tensor"), "{why}");
        // A group of one: the root has nobody to wait for.
        g.broadcast(&[("t".to_string(), t)], 0).unwrap();
    }
}
