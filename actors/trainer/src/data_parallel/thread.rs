//! [`ThreadCollective`]: the ranks of a group as threads of one process, exchanging CPU
//! tensors through shared slots and a barrier (what gloo does between processes). Every
//! rank combines the deposits in rank order, so all ranks get the same bits.
//!
//! A rank that leaves (its handle dropped, say after an error) fails the group: ranks
//! waiting in a collective, and any later one, get [`CollectiveError::PeerFailed`]
//! instead of waiting forever.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tch::{Device, Tensor};

use super::{
    check_flat, check_pair, check_rank, combine_in_rank_order, Collective, CollectiveError,
    ReduceOp,
};

/// One rank's contribution to the collective in progress.
struct Deposit {
    op: &'static str,
    tensor: Tensor,
}

struct State {
    arrived: usize,
    generation: u64,
    failed: Option<String>,
    slots: Vec<Option<Deposit>>,
    taken: Vec<bool>,
}

/// The shared side of a thread group; hand out one [`ThreadCollective`] per rank.
pub struct ThreadGroup {
    world: usize,
    state: Mutex<State>,
    wake: Condvar,
}

impl ThreadGroup {
    /// A group of `world` ranks (at least 1).
    pub fn new(world: usize) -> Result<Arc<Self>, CollectiveError> {
        check_rank(0, world)?;
        Ok(Arc::new(Self {
            world,
            state: Mutex::new(State {
                arrived: 0,
                generation: 0,
                failed: None,
                slots: (0..world).map(|_| None).collect(),
                taken: vec![false; world],
            }),
            wake: Condvar::new(),
        }))
    }

    /// This group's handle for `rank`; each rank can be taken once.
    pub fn join(self: &Arc<Self>, rank: usize) -> Result<ThreadCollective, CollectiveError> {
        check_rank(rank, self.world)?;
        let mut s = self.lock();
        if s.taken[rank] {
            return Err(CollectiveError::RankTaken(rank));
        }
        s.taken[rank] = true;
        Ok(ThreadCollective {
            group: Arc::clone(self),
            rank,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadCollective {
    group: Arc<ThreadGroup>,
    rank: usize,
}

impl ThreadCollective {
    /// Every rank of a new group of `world`, in rank order.
    pub fn group(world: usize) -> Result<Vec<Self>, CollectiveError> {
        let g = ThreadGroup::new(world)?;
        (0..world).map(|r| g.join(r)).collect()
    }

    /// Waits until every rank arrives; fails if the group has failed.
    fn barrier(&self) -> Result<(), CollectiveError> {
        let g = &self.group;
        let mut s = g.lock();
        if let Some(f) = &s.failed {
            return Err(CollectiveError::PeerFailed(f.clone()));
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == g.world {
            s.arrived = 0;
            s.generation += 1;
            g.wake.notify_all();
            return Ok(());
        }
        while s.generation == generation && s.failed.is_none() {
            s = g.wake.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match (&s.failed, s.generation == generation) {
            (Some(f), true) => Err(CollectiveError::PeerFailed(f.clone())),
            _ => Ok(()),
        }
    }

    /// Deposits a copy of `tensor`, waits for every rank's, checks they agree and
    /// returns them in rank order. The caller must call [`Self::barrier`] once done
    /// reading, before the slots are reused.
    fn exchange(&self, op: &'static str, tensor: &Tensor) -> Result<Vec<Tensor>, CollectiveError> {
        {
            let mut s = self.group.lock();
            s.slots[self.rank] = Some(Deposit {
                op,
                tensor: tensor.detach().copy(),
            });
        }
        self.barrier()?;
        let s = self.group.lock();
        let mut out = Vec::with_capacity(self.group.world);
        for (r, slot) in s.slots.iter().enumerate() {
            let d = slot.as_ref().ok_or_else(|| CollectiveError::Mismatch {
                op,
                message: format!("rank {r} deposited nothing"),
            })?;
            if d.op != op {
                return Err(CollectiveError::Mismatch {
                    op,
                    message: format!("rank {r} is in {}", d.op),
                });
            }
            if d.tensor.size() != tensor.size() || d.tensor.kind() != tensor.kind() {
                return Err(CollectiveError::Mismatch {
                    op,
                    message: format!(
                        "rank {r} sent {:?} {:?}, rank {} sent {:?} {:?}",
                        d.tensor.kind(),
                        d.tensor.size(),
                        self.rank,
                        tensor.kind(),
                        tensor.size()
                    ),
                });
            }
            out.push(d.tensor.shallow_clone());
        }
        Ok(out)
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        let mut s = self.group.lock();
        if s.failed.is_none() {
            s.failed = Some(format!("rank {} left the group", self.rank));
        }
        self.group.wake.notify_all();
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
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
        check_pair(
            "reduce_scatter",
            Device::Cpu,
            input,
            output,
            self.group.world,
        )?;
        let parts = self.exchange("reduce_scatter", input)?;
        let n = output.numel() as i64;
        let mine: Vec<Tensor> = parts
            .iter()
            .map(|p| p.narrow(0, self.rank as i64 * n, n))
            .collect();
        let result = combine_in_rank_order(&mine, op, self.group.world);
        self.barrier()?;
        tch::no_grad(|| output.copy_(&result));
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        check_pair("all_gather", Device::Cpu, output, input, self.group.world)?;
        let parts = self.exchange("all_gather", input)?;
        let result = Tensor::cat(&parts, 0);
        self.barrier()?;
        tch::no_grad(|| output.copy_(&result));
        Ok(())
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError> {
        check_flat("all_reduce", Device::Cpu, tensor)?;
        let parts = self.exchange("all_reduce", tensor)?;
        let result = combine_in_rank_order(&parts, op, self.group.world);
        self.barrier()?;
        tch::no_grad(|| tensor.copy_(&result));
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        check_rank(root, self.group.world)?;
        check_flat("broadcast", Device::Cpu, tensor)?;
        let parts = self.exchange("broadcast", tensor)?;
        let result = parts[root].shallow_clone();
        self.barrier()?;
        // The deposit is a copy, so nothing reads it once every rank passed the barrier.
        tch::no_grad(|| tensor.copy_(&result));
        Ok(())
    }
}
