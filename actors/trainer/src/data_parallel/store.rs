//! [`StoreCollective`]: data-parallel ranks in separate processes (trainer ranks on
//! different worker daemons) without GPUs, exchanging CPU tensors through rank 0's
//! torch `TCPStore` (`manta_cuda::rendezvous`, the c10d store NCCL groups meet at).
//! It is what lets the cross-process protocol — rank 0 hosting the rendezvous, the
//! driver carrying its address to the other ranks, every rank building
//! `Trainer::new_data_parallel` — run for real on CPU machines and in CI; GPU ranks use
//! [`super::NcclCollective`] instead.
//!
//! Every collective has a sequence number (all ranks call the same collectives in the
//! same order). In collective `s` each rank sets its deposits under
//! `<group>/<s>/<src>/<dst>` — a 16-byte header (operation, kind, element count) and the
//! tensor's bytes — and reads what it needs from every rank. Results are combined in
//! rank order with the same tensor ops as [`super::ThreadCollective`], so every rank gets
//! the same bits, and the same bits as thread ranks on the same inputs.
//!
//! A rank deletes what it set in collective `s - 1` once it has read every rank's
//! deposit of collective `s` (each rank deposits something in every collective, a
//! header-only marker where it has no data): a rank deposits for `s` only after
//! finishing `s - 1`, so by then nobody reads those keys any more and the store holds
//! at most two collectives' data.
//!
//! Rank 0 hosts the store, so its process must outlive the other ranks' last
//! collective (as the process that made an NCCL id must outlive the joins). A rank
//! waits for a deposit by polling the store (`check`, backing off to 2 ms between
//! polls) rather than blocking in `get`, so a wait ends with
//! [`CollectiveError::PeerFailed`] when rank 0's store goes away, when the group's
//! timeout passes, or at once when the rank is aborted ([`StoreAborter`]: its worker
//! stops the rank, e.g. after the driver found another rank lost) — a rank never stays
//! blocked on a peer that is gone.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_cuda::rendezvous::{StoreError, TcpStore};
use tch::{Device, Kind, Tensor};

use super::{
    check_flat, check_pair, check_rank, combine_in_rank_order, Collective, CollectiveError,
    ReduceOp,
};

/// Where a group's store is and who this rank is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreGroupSpec {
    /// Host the other ranks reach rank 0's store at (rank 0 itself listens on every
    /// interface).
    pub master_address: String,
    /// Rank 0's store port (0 for rank 0 hosting: any free port, see
    /// [`StoreCollective::port`]).
    pub master_port: u16,
    /// Prefix of every key, so groups sharing a store never read each other's values.
    pub group: String,
    pub rank: usize,
    pub world: usize,
    /// Bounds every wait: connecting, and each collective's reads.
    pub timeout: Duration,
}

/// Ends a [`StoreCollective`]'s waits from another thread: the collective in progress
/// and every later one fail instead of waiting for peers.
#[derive(Clone, Debug, Default)]
pub struct StoreAborter(Arc<AtomicBool>);

impl StoreAborter {
    pub fn abort(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn aborted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One rank of a group exchanging tensors through rank 0's `TCPStore`.
pub struct StoreCollective {
    store: TcpStore,
    group: String,
    rank: usize,
    world: usize,
    /// How long one wait for a peer's deposit may take.
    timeout: Duration,
    aborter: StoreAborter,
    /// The next collective's sequence number.
    seq: Cell<u64>,
    /// Keys this rank set in the previous collective, deleted after the current one.
    set_before: RefCell<Vec<String>>,
}

/// Operation tags in a deposit's header: ranks in different collectives are caught.
fn op_tag(op: &str) -> u32 {
    match op {
        "reduce_scatter" => 1,
        "all_gather" => 2,
        "all_reduce" => 3,
        "broadcast" => 4,
        _ => 0,
    }
}

/// The kinds a deposit may carry, as numbered in its header.
fn kind_tag(op: &'static str, kind: Kind) -> Result<u32, CollectiveError> {
    Ok(match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::BFloat16 => 3,
        Kind::Half => 4,
        Kind::Int64 => 5,
        Kind::Int => 6,
        other => {
            return Err(CollectiveError::BadTensor {
                op,
                message: format!("{other:?} tensors are not supported"),
            })
        }
    })
}

const HEADER: usize = 16;

fn store_failed(e: StoreError) -> CollectiveError {
    CollectiveError::PeerFailed(e.to_string())
}

/// A dense CPU tensor's memory.
fn bytes_of(t: &Tensor) -> &[u8] {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: callers pass contiguous CPU tensors (checked by check_flat/check_pair);
    // the slice lives no longer than `t`.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
}

impl StoreCollective {
    /// Joins (rank 0: hosts) the group's store. Rank 0 returns at once; the others retry
    /// the connection until `spec.timeout`.
    pub fn join(spec: &StoreGroupSpec) -> Result<Self, CollectiveError> {
        check_rank(spec.rank, spec.world)?;
        let store = if spec.rank == 0 {
            TcpStore::host(spec.master_port, spec.world, spec.timeout)
        } else {
            TcpStore::connect(&spec.master_address, spec.master_port, spec.timeout)
        }
        .map_err(|e| {
            CollectiveError::Unavailable(format!(
                "rank {} of store group {:?} at {}:{}: {e}",
                spec.rank, spec.group, spec.master_address, spec.master_port
            ))
        })?;
        Ok(Self::over(store, spec))
    }

    /// Rank `spec.rank` of a group over an open store (rank 0's store opened ahead of
    /// the group, so its port can be handed to the other ranks first).
    pub fn over(store: TcpStore, spec: &StoreGroupSpec) -> Self {
        Self {
            store,
            group: spec.group.clone(),
            rank: spec.rank,
            world: spec.world,
            timeout: spec.timeout,
            aborter: StoreAborter::default(),
            seq: Cell::new(0),
            set_before: RefCell::new(Vec::new()),
        }
    }

    /// The port of the store this rank is connected to (rank 0: the one it hosts).
    pub fn port(&self) -> u16 {
        self.store.port()
    }

    /// A handle that ends this rank's waits from another thread.
    pub fn aborter(&self) -> StoreAborter {
        self.aborter.clone()
    }

    /// Waits until `key` is set: polls, backing off from 50 µs to 2 ms, until it is, the
    /// rank is aborted, or the group's timeout passes.
    fn wait_for(&self, key: &str) -> Result<(), CollectiveError> {
        let started = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            if self.store.check(key).map_err(store_failed)? {
                return Ok(());
            }
            if self.aborter.aborted() {
                return Err(CollectiveError::PeerFailed(format!(
                    "rank {} of group {:?} was stopped while waiting for {key}",
                    self.rank, self.group
                )));
            }
            if started.elapsed() > self.timeout {
                return Err(CollectiveError::PeerFailed(format!(
                    "no deposit {key} within {:?}: a rank of group {:?} is gone or stuck",
                    self.timeout, self.group
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    fn key(&self, seq: u64, src: usize, dst: usize) -> String {
        format!("{}/{seq}/{src}/{dst}", self.group)
    }

    /// Sets this rank's deposit for `dst` in collective `seq`.
    fn deposit(
        &self,
        seq: u64,
        dst: usize,
        op: &'static str,
        t: Option<&Tensor>,
        set: &mut Vec<String>,
    ) -> Result<(), CollectiveError> {
        let (kind, numel, bytes) = match t {
            Some(t) => (kind_tag(op, t.kind())?, t.numel() as u64, bytes_of(t)),
            None => (0, 0, &[][..]),
        };
        let mut value = Vec::with_capacity(HEADER + bytes.len());
        value.extend_from_slice(&op_tag(op).to_le_bytes());
        value.extend_from_slice(&kind.to_le_bytes());
        value.extend_from_slice(&numel.to_le_bytes());
        value.extend_from_slice(bytes);
        let key = self.key(seq, self.rank, dst);
        self.store.set(&key, &value).map_err(store_failed)?;
        set.push(key);
        Ok(())
    }

    /// Reads rank `src`'s deposit for this rank in collective `seq`, checking that it is
    /// the same operation; `like` (None: a marker is expected) gives the kind and size.
    fn take(
        &self,
        seq: u64,
        src: usize,
        op: &'static str,
        like: Option<&Tensor>,
    ) -> Result<Option<Tensor>, CollectiveError> {
        let key = self.key(seq, src, self.rank);
        self.wait_for(&key)?;
        let value = self.store.get(&key).map_err(store_failed)?;
        let mismatch = |message: String| CollectiveError::Mismatch { op, message };
        if value.len() < HEADER {
            return Err(mismatch(format!(
                "rank {src} sent {} bytes, less than a header",
                value.len()
            )));
        }
        let word =
            |i: usize| u32::from_le_bytes([value[i], value[i + 1], value[i + 2], value[i + 3]]);
        let their_op = word(0);
        if their_op != op_tag(op) {
            return Err(mismatch(format!(
                "rank {src} is in another collective (tag {their_op}) as collective {seq}"
            )));
        }
        let Some(like) = like else {
            return Ok(None);
        };
        let mut numel_bytes = [0u8; 8];
        numel_bytes.copy_from_slice(&value[8..16]);
        let numel = u64::from_le_bytes(numel_bytes);
        let kind = kind_tag(op, like.kind())?;
        let want = like.numel() * like.kind().elt_size_in_bytes();
        if word(4) != kind || numel != like.numel() as u64 || value.len() - HEADER != want {
            return Err(mismatch(format!(
                "rank {src} sent kind tag {} × {numel}, rank {} expects {:?} × {}",
                word(4),
                self.rank,
                like.kind(),
                like.numel()
            )));
        }
        Ok(Some(Tensor::from_data_size(
            &value[HEADER..],
            &[like.numel() as i64],
            like.kind(),
        )))
    }

    /// One collective: this rank deposits `outgoing[dst]` for each rank (None: a
    /// marker), then reads every rank's deposit for it (`like`: the expected shape of
    /// each, None for a marker), in rank order. Deletes what it set last time once all
    /// are read.
    fn exchange(
        &self,
        op: &'static str,
        outgoing: &[Option<Tensor>],
        like: &[Option<&Tensor>],
    ) -> Result<Vec<Option<Tensor>>, CollectiveError> {
        if self.aborter.aborted() {
            return Err(CollectiveError::PeerFailed(format!(
                "rank {} of group {:?} was stopped",
                self.rank, self.group
            )));
        }
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        let mut set = Vec::with_capacity(self.world);
        for (dst, t) in outgoing.iter().enumerate() {
            if dst != self.rank {
                self.deposit(seq, dst, op, t.as_ref(), &mut set)?;
            }
        }
        let mut received = Vec::with_capacity(self.world);
        for src in 0..self.world {
            if src == self.rank {
                received.push(outgoing[src].as_ref().map(|t| t.shallow_clone()));
            } else {
                received.push(self.take(seq, src, op, like[src])?);
            }
        }
        // Every rank has deposited for `seq`, so each finished reading `seq - 1`.
        for key in self.set_before.replace(set) {
            self.store.delete(&key).map_err(store_failed)?;
        }
        Ok(received)
    }
}

fn all_present(
    op: &'static str,
    parts: Vec<Option<Tensor>>,
) -> Result<Vec<Tensor>, CollectiveError> {
    parts
        .into_iter()
        .enumerate()
        .map(|(r, p)| {
            p.ok_or_else(|| CollectiveError::Mismatch {
                op,
                message: format!("rank {r} sent no data"),
            })
        })
        .collect()
}

impl Collective for StoreCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, Device::Cpu, input, output, self.world)?;
        let n = output.numel() as i64;
        // Each rank needs only its slice of every rank's input.
        let outgoing: Vec<Option<Tensor>> = (0..self.world)
            .map(|dst| Some(input.narrow(0, dst as i64 * n, n).contiguous()))
            .collect();
        let like = vec![Some(&*output); self.world];
        let parts = all_present(OP, self.exchange(OP, &outgoing, &like)?)?;
        let result = combine_in_rank_order(&parts, op, self.world);
        tch::no_grad(|| output.copy_(&result));
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        const OP: &str = "all_gather";
        check_pair(OP, Device::Cpu, output, input, self.world)?;
        let outgoing: Vec<Option<Tensor>> = (0..self.world)
            .map(|_| Some(input.shallow_clone()))
            .collect();
        let like = vec![Some(input); self.world];
        let parts = all_present(OP, self.exchange(OP, &outgoing, &like)?)?;
        let result = Tensor::cat(&parts, 0);
        tch::no_grad(|| output.copy_(&result));
        Ok(())
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        check_flat(OP, Device::Cpu, tensor)?;
        let mine = tensor.detach().copy();
        let outgoing: Vec<Option<Tensor>> = (0..self.world)
            .map(|_| Some(mine.shallow_clone()))
            .collect();
        let like = vec![Some(&mine); self.world];
        let parts = all_present(OP, self.exchange(OP, &outgoing, &like)?)?;
        let result = combine_in_rank_order(&parts, op, self.world);
        tch::no_grad(|| tensor.copy_(&result));
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        const OP: &str = "broadcast";
        check_rank(root, self.world)?;
        check_flat(OP, Device::Cpu, tensor)?;
        let mine = tensor.detach().copy();
        // The root sends its tensor; the others a marker, so every rank hears from every
        // rank in every collective (what makes deleting the last one's keys safe).
        let outgoing: Vec<Option<Tensor>> = (0..self.world)
            .map(|_| (self.rank == root).then(|| mine.shallow_clone()))
            .collect();
        let like: Vec<Option<&Tensor>> = (0..self.world)
            .map(|src| (src == root).then_some(&mine))
            .collect();
        let mut parts = self.exchange(OP, &outgoing, &like)?;
        if self.rank != root {
            let from_root = parts[root]
                .take()
                .ok_or_else(|| CollectiveError::Mismatch {
                    op: OP,
                    message: format!("rank {root} sent no data"),
                })?;
            tch::no_grad(|| tensor.copy_(&from_root));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_parallel::ThreadCollective;

    fn spec(rank: usize, world: usize, port: u16) -> StoreGroupSpec {
        StoreGroupSpec {
            master_address: "127.0.0.1".into(),
            master_port: port,
            group: "t".into(),
            rank,
            world,
            timeout: Duration::from_secs(20),
        }
    }

    /// Runs `f` on every rank of a store group of `world` (threads, each with a store
    /// connection of its own, as separate processes would have) and of a thread group.
    fn both<T: Send + 'static>(
        world: usize,
        f: impl Fn(&dyn Collective) -> T + Send + Sync + Clone + 'static,
    ) -> (Vec<T>, Vec<T>) {
        let root = StoreCollective::join(&spec(0, world, 0)).unwrap();
        let port = root.port();
        let f0 = f.clone();
        // Rank 0 hosts the store: it is kept until every rank is done reading from it.
        let first = std::thread::spawn(move || (f0(&root), root));
        let others: Vec<_> = (1..world)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(
                    move || f(&StoreCollective::join(&spec(r, world, port)).unwrap()),
                )
            })
            .collect();
        let mut store: Vec<T> = others.into_iter().map(|h| h.join().unwrap()).collect();
        let (t0, root) = first.join().unwrap();
        store.insert(0, t0);
        drop(root);
        let thread: Vec<T> = ThreadCollective::group(world)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(&c))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        (store, thread)
    }

    /// Values whose fp32 sums depend on the order they are added in.
    fn input(rank: usize, n: i64) -> Tensor {
        let t = Tensor::arange(n, (Kind::Float, Device::Cpu));
        (t * 0.1 + 1.0).pow_tensor_scalar(rank as f64 + 1.5) * 1e-3 + (rank as f64) * 1e7
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        Vec::<f32>::try_from(t)
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect()
    }

    #[test]
    fn store_ranks_get_the_same_bits_as_thread_ranks() {
        let (store, thread) = both(3, |c: &dyn Collective| {
            let (r, w) = (c.rank(), c.world_size());
            let n = 5;
            let mut out = Vec::new();
            let mut rs = Tensor::zeros([n], (Kind::Float, Device::Cpu));
            c.reduce_scatter(&input(r, n * w as i64), &mut rs, ReduceOp::Sum)
                .unwrap();
            out.push(bits(&rs));
            let mut mean = input(r, 7);
            c.all_reduce(&mut mean, ReduceOp::Mean).unwrap();
            out.push(bits(&mean));
            let mut max = input(w - 1 - r, 4);
            c.all_reduce(&mut max, ReduceOp::Max).unwrap();
            out.push(bits(&max));
            let mut gathered = Tensor::zeros([3 * w as i64], (Kind::Float, Device::Cpu));
            c.all_gather(&input(r, 3), &mut gathered).unwrap();
            out.push(bits(&gathered));
            let mut b = input(r, 6);
            c.broadcast(&mut b, 1).unwrap();
            out.push(bits(&b));
            let mut f = [r as f64 + 0.25, 1.0];
            c.all_reduce_f64(&mut f, ReduceOp::Sum).unwrap();
            out.push(f.iter().map(|x| x.to_bits()).collect());
            // Ranks hold 1, 1e8 and -1e8: (1 + 1e8) - 1e8 is 0 in fp32, any other order 1.
            let mut order = Tensor::from_slice(&[[1.0f32, 1e8, -1e8][r]]);
            c.all_reduce(&mut order, ReduceOp::Sum).unwrap();
            out.push(bits(&order));
            out
        });
        for r in 1..3 {
            // All-reduce, all-gather and broadcast results agree across ranks.
            assert_eq!(store[r][1..], store[0][1..], "rank {r}");
        }
        assert_eq!(store, thread, "store ranks and thread ranks disagree");
        for (r, results) in store.iter().enumerate() {
            assert_eq!(results[6], vec![0], "rank {r} did not sum in rank order");
        }
    }

    #[test]
    fn ranks_in_different_collectives_are_told_so() {
        let root = StoreCollective::join(&spec(0, 2, 0)).unwrap();
        let port = root.port();
        let other = std::thread::spawn(move || {
            let c = StoreCollective::join(&spec(1, 2, port)).unwrap();
            let mut t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
            c.broadcast(&mut t, 0).map(|_| ())
        });
        let mut t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let err = root.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert!(err.to_string().contains("another collective"), "{err}");
        let err = other.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("another collective"), "{err}");
    }

    #[test]
    fn an_aborted_rank_stops_waiting_at_once() {
        let root = StoreCollective::join(&spec(0, 2, 0)).unwrap();
        let aborter = root.aborter();
        let waiting = std::thread::spawn(move || {
            let mut t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            let started = Instant::now();
            let err = root.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
            (err, started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        aborter.abort();
        let (err, waited) = waiting.join().unwrap();
        assert!(err.to_string().contains("was stopped"), "{err}");
        // Far sooner than the group's 20 s timeout.
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[test]
    fn a_rank_that_never_comes_fails_the_wait_instead_of_hanging() {
        let mut s = spec(0, 2, 0);
        s.timeout = Duration::from_millis(300);
        let root = StoreCollective::join(&s).unwrap();
        let mut t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let err = root.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, CollectiveError::PeerFailed(_)), "{err}");
    }
}
