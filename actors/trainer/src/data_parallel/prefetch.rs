//! ZeRO-3's layer prefetch: when the decoder asks for layer i's parameters, the all-gather
//! of the layer it will ask for next is queued right away on a side stream, so it runs
//! while layer i computes, as DeepSpeed's and FSDP's prefetch do. The next layer is
//! guessed from the order of the requests (no schedule is shared with the model): the
//! same direction as the last move — i + 1 going forward, i − 1 going backward — and the
//! same layer asked for twice in a row is the turn from a pass's forward to its backward
//! (recompute every layer: the last layer is gathered again first). Nothing is guessed
//! past either end, nor a layer that is gathered already or whose backward is done in
//! this pass. A wrong guess costs a wasted all-gather, never a result: the layer asked
//! for is gathered then and there, and the guessed one is dropped.
//!
//! [`PrefetchPlanner`] is the guess alone (plain bookkeeping, tested below);
//! [`super::Zero3Pass`] is the pass's `LayerHooks`, which carries the guesses out through
//! the optimizer (its gathers, the side stream and the events ordering it). Every rank
//! makes the same requests in a pass, so every rank makes the same guesses and the
//! collectives pair up on the CPU backends too, where a "prefetch" is an all-gather made
//! early on the calling thread.

/// What a pass does about a gather request ([`PrefetchPlanner::gather`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherPlan {
    /// The layer asked for was gathered ahead: only wait for that gather.
    pub prefetched: bool,
    /// A layer gathered ahead that is not the one asked for: the guess was wrong, drop it.
    pub drop: Option<usize>,
    /// The layer to gather ahead now, after the one asked for.
    pub ahead: Option<usize>,
}

/// How a pass's gather guesses went (a rank's running totals).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// All-gathers queued ahead of their request.
    pub issued: u64,
    /// Of those, the ones the next request asked for.
    pub used: u64,
    /// Of those, the ones dropped unused (a wrong guess, or the pass ended first).
    pub wasted: u64,
    /// Layer collectives (gathers and reduce-scatters) queued on the side stream: NCCL
    /// ranks only; 0 where collectives run at once (the CPU backends).
    pub on_side_stream: u64,
}

/// One pass's guesses of the next layer, from the layers asked for so far.
#[derive(Debug, Clone)]
pub struct PrefetchPlanner {
    /// The layer of the last gather request.
    last: Option<usize>,
    /// Layers whose parameters are gathered now (asked for, not yet released or reduced).
    held: Vec<bool>,
    /// Layers whose backward is done in this pass: not asked for again.
    reduced: Vec<bool>,
    /// The layer gathered ahead and not yet asked for.
    pending: Option<usize>,
}

impl PrefetchPlanner {
    /// A pass over a decoder of `layers` layers.
    pub fn new(layers: usize) -> Self {
        Self {
            last: None,
            held: vec![false; layers],
            reduced: vec![false; layers],
            pending: None,
        }
    }

    fn layers(&self) -> usize {
        self.held.len()
    }

    /// Layer `layer` is asked for (it must be whole from now on).
    pub fn gather(&mut self, layer: usize) -> GatherPlan {
        let (prefetched, drop) = match self.pending.take() {
            Some(p) if p == layer => (true, None),
            other => (false, other),
        };
        // The first request of a pass goes forward; the same layer twice in a row is the
        // turn into the backward pass.
        let forward = self.last.is_none_or(|last| layer > last);
        self.last = Some(layer);
        if let Some(h) = self.held.get_mut(layer) {
            *h = true;
        }
        let next = if forward {
            layer.checked_add(1).filter(|&n| n < self.layers())
        } else {
            layer.checked_sub(1)
        };
        let ahead = next.filter(|&n| !self.held[n] && !self.reduced[n]);
        self.pending = ahead;
        GatherPlan {
            prefetched,
            drop,
            ahead,
        }
    }

    /// Layer `layer`'s forward is done and nothing reads its parameters until it is asked
    /// for again. Returns a layer gathered ahead to drop: only if it is this one, which
    /// the model never does (it releases what it asked for).
    pub fn release(&mut self, layer: usize) -> Option<usize> {
        if let Some(h) = self.held.get_mut(layer) {
            *h = false;
        }
        self.pending.take_if(|p| *p == layer)
    }

    /// Layer `layer`'s backward is done: it is not asked for again in this pass. Returns
    /// a layer gathered ahead to drop, as [`PrefetchPlanner::release`].
    pub fn reduce(&mut self, layer: usize) -> Option<usize> {
        if let Some(r) = self.reduced.get_mut(layer) {
            *r = true;
        }
        self.release(layer)
    }

    /// The pass is over: the layer gathered ahead and never asked for, to drop.
    pub fn finish(&mut self) -> Option<usize> {
        self.pending.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hook call the decoder makes.
    #[derive(Debug, Clone, Copy)]
    enum Call {
        Gather(usize),
        Release(usize),
        Reduce(usize),
    }
    use Call::{Gather as G, Reduce as D, Release as R};

    /// A gather's (layer, served by a prefetch, dropped, gathered ahead).
    type Decision = (usize, bool, Option<usize>, Option<usize>);

    /// What the planner did over `calls`: each gather's [`Decision`], then what the end
    /// of the pass dropped.
    fn run(layers: usize, calls: &[Call]) -> (Vec<Decision>, Option<usize>) {
        let mut p = PrefetchPlanner::new(layers);
        let mut out = Vec::new();
        for &c in calls {
            match c {
                G(i) => {
                    let plan = p.gather(i);
                    out.push((i, plan.prefetched, plan.drop, plan.ahead));
                }
                R(i) => assert_eq!(p.release(i), None, "release {i}"),
                D(i) => assert_eq!(p.reduce(i), None, "reduce {i}"),
            }
        }
        (out, p.finish())
    }

    /// The decoder's calls (crate::layer_hooks in manta_model) over 4 layers: a log-prob
    /// pass, and training passes with every layer recomputed, block recompute of the
    /// first 2 layers, and no recompute. Each gather after the first in a direction is
    /// served by the guess of the request before it, and nothing is wasted.
    #[test]
    fn the_next_layer_is_guessed_in_the_direction_of_the_pass() {
        // forward_hidden_hooked: each layer gathered and released in turn.
        let (plans, left) = run(4, &[G(0), R(0), G(1), R(1), G(2), R(2), G(3), R(3)]);
        assert_eq!(
            plans,
            vec![
                (0, false, None, Some(1)),
                (1, true, None, Some(2)),
                (2, true, None, Some(3)),
                (3, true, None, None),
            ]
        );
        assert_eq!(left, None);

        // Every layer recomputed: the forward as above, then the backward from the last
        // layer (asked for twice in a row: the turn), each recomputed and reduced.
        let forward = [G(0), R(0), G(1), R(1), G(2), R(2), G(3), R(3)];
        let backward = [G(3), D(3), G(2), D(2), G(1), D(1), G(0), D(0)];
        let (plans, left) = run(4, &[&forward[..], &backward[..]].concat());
        assert_eq!(
            plans[4..],
            [
                (3, false, None, Some(2)),
                (2, true, None, Some(1)),
                (1, true, None, Some(0)),
                (0, true, None, None),
            ]
        );
        assert_eq!(left, None);

        // Block recompute of 2 of 4: layers 0 and 1 recomputed, 2 and 3 kept gathered
        // from their forward to their backward (reduced last first), then 1 and 0
        // recomputed in the backward.
        let (plans, left) = run(
            4,
            &[
                G(0),
                R(0),
                G(1),
                R(1),
                G(2),
                G(3),
                D(3),
                D(2),
                G(1),
                D(1),
                G(0),
                D(0),
            ],
        );
        assert_eq!(
            plans,
            vec![
                (0, false, None, Some(1)),
                (1, true, None, Some(2)),
                (2, true, None, Some(3)),
                (3, true, None, None),
                (1, false, None, Some(0)),
                (0, true, None, None),
            ]
        );
        assert_eq!(left, None);

        // No recompute: every layer gathered before the forward, reduced after the
        // backward.
        let (plans, left) = run(4, &[G(0), G(1), G(2), G(3), D(3), D(2), D(1), D(0)]);
        assert_eq!(
            plans.iter().map(|p| (p.1, p.3)).collect::<Vec<_>>(),
            vec![
                (false, Some(1)),
                (true, Some(2)),
                (true, Some(3)),
                (true, None)
            ]
        );
        assert_eq!(left, None);
    }

    /// Uniform groups of 2 recompute each group forward in the backward pass: the guesses
    /// after each jump back are wrong and dropped, a layer already reduced is never
    /// guessed, and the pass ends with its last guess dropped. Only the guesses change:
    /// every layer asked for is still gathered.
    #[test]
    fn wrong_guesses_are_dropped_and_reduced_layers_never_guessed() {
        let forward = [G(0), R(0), G(1), R(1), G(2), R(2), G(3), R(3)];
        let backward = [G(2), G(3), D(3), D(2), G(0), G(1), D(1), D(0)];
        let (plans, left) = run(4, &[&forward[..], &backward[..]].concat());
        assert_eq!(
            plans[4..],
            [
                // 3 → 2 goes backward: 1 guessed, but the group goes on to 3.
                (2, false, None, Some(1)),
                (3, false, Some(1), None),
                // A jump back to the first group: −1 guessed, off the end.
                (0, false, None, None),
                // Forward again: 2 is reduced, so nothing is guessed.
                (1, false, None, None),
            ]
        );
        assert_eq!(left, None);
        // A guess the pass never asks for is dropped at its end.
        let (plans, left) = run(3, &[G(0), G(1), D(1), D(0)]);
        assert_eq!(plans[1], (1, true, None, Some(2)));
        assert_eq!(left, Some(2));
    }

    /// A release or reduce of the layer guessed ahead (not a pattern of the decoder)
    /// drops the guess rather than leaving a gather behind it.
    #[test]
    fn releasing_the_guessed_layer_drops_its_gather() {
        let mut p = PrefetchPlanner::new(3);
        assert_eq!(p.gather(0).ahead, Some(1));
        assert_eq!(p.release(1), Some(1));
        assert_eq!(p.finish(), None);
        let mut p = PrefetchPlanner::new(3);
        assert_eq!(p.gather(2).ahead, None, "nothing past the last layer");
        let mut p = PrefetchPlanner::new(3);
        p.gather(1);
        assert_eq!(p.reduce(2), Some(2));
        assert_eq!(p.finish(), None);
    }
}
