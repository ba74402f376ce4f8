//! The CPU collective (`ThreadCollective`) against plain sums over random data, the
//! ZeRO-2 optimizer against the whole AdamW on shards that do not divide evenly, and
//! bad group configurations as clear errors (the NCCL backend's included: it checks
//! them before touching a GPU, and says why it cannot run on a machine without one).

use std::collections::BTreeMap;

use manta_trainer::data_parallel::{
    Collective, CollectiveError, NcclCollective, ReduceOp, ThreadCollective, ThreadGroup, ZeroAdamW,
};
use manta_trainer::optimizer::{AdamW, AdamWConfig};
use tch::{Kind, Tensor};

/// Runs `f` on every rank of a new thread group of `world`, results in rank order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(ThreadCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = ThreadCollective::group(world)
        .unwrap()
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Random data per rank, as plain vectors (drawn before any thread starts).
fn random(world: usize, n: usize, seed: i64) -> Vec<Vec<f32>> {
    tch::manual_seed(seed);
    (0..world)
        .map(|_| {
            Vec::<f32>::try_from(Tensor::randn([n as i64], (Kind::Float, tch::Device::Cpu)))
                .unwrap()
        })
        .collect()
}

fn close(a: &[f32], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= 1e-5 * y.abs().max(1.0),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn reduce_scatter_sums_or_averages_each_ranks_slice() {
    for world in [1usize, 2, 3, 4] {
        // 5 elements per rank: an odd slice.
        let n = 5;
        let data = random(world, world * n, world as i64);
        let sums: Vec<f64> = (0..world * n)
            .map(|i| data.iter().map(|d| d[i] as f64).sum())
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let input = data.clone();
            let out = on_ranks(world, move |c| {
                let x = Tensor::from_slice(&input[c.rank()]);
                let mut y = Tensor::zeros([n as i64], (Kind::Float, tch::Device::Cpu));
                c.reduce_scatter(&x, &mut y, op).unwrap();
                Vec::<f32>::try_from(y).unwrap()
            });
            for (r, got) in out.iter().enumerate() {
                let scale = if op == ReduceOp::Mean {
                    world as f64
                } else {
                    1.0
                };
                let want: Vec<f64> = sums[r * n..(r + 1) * n].iter().map(|s| s / scale).collect();
                close(got, &want, &format!("world {world} {op:?} rank {r}"));
            }
        }
    }
}

#[test]
fn all_gather_all_reduce_and_broadcast_match_plain_loops() {
    for world in [1usize, 2, 3] {
        let n = 7;
        let data = random(world, n, 10 + world as i64);
        let input = data.clone();
        let out = on_ranks(world, move |c| {
            let x = Tensor::from_slice(&input[c.rank()]);
            let mut gathered = Tensor::zeros([(world * n) as i64], (Kind::Float, tch::Device::Cpu));
            c.all_gather(&x, &mut gathered).unwrap();
            let mut summed = x.copy();
            c.all_reduce(&mut summed, ReduceOp::Sum).unwrap();
            let mut maxed = x.copy();
            c.all_reduce(&mut maxed, ReduceOp::Max).unwrap();
            let mut root_last = x.copy();
            c.broadcast(&mut root_last, world - 1).unwrap();
            let mut scalars = [c.rank() as f64 + 0.5, 2.0];
            c.all_reduce_f64(&mut scalars, ReduceOp::Sum).unwrap();
            let v = |t: Tensor| Vec::<f32>::try_from(t).unwrap();
            (v(gathered), v(summed), v(maxed), v(root_last), scalars)
        });
        let concat: Vec<f64> = data.iter().flatten().map(|&x| x as f64).collect();
        let sum: Vec<f64> = (0..n)
            .map(|i| data.iter().map(|d| d[i] as f64).sum())
            .collect();
        let max: Vec<f64> = (0..n)
            .map(|i| data.iter().map(|d| d[i] as f64).fold(f64::MIN, f64::max))
            .collect();
        let last: Vec<f64> = data[world - 1].iter().map(|&x| x as f64).collect();
        let ranks_sum: f64 = (0..world).map(|r| r as f64 + 0.5).sum();
        for (r, (g, s, m, b, scalars)) in out.iter().enumerate() {
            close(g, &concat, &format!("all_gather world {world} rank {r}"));
            close(s, &sum, &format!("all_reduce sum world {world} rank {r}"));
            close(m, &max, &format!("all_reduce max world {world} rank {r}"));
            close(b, &last, &format!("broadcast world {world} rank {r}"));
            assert_eq!(*scalars, [ranks_sum, 2.0 * world as f64]);
        }
        // Every rank gets the same bits.
        assert!(out.iter().all(|o| o.1 == out[0].1));
    }
}

fn adam() -> AdamWConfig {
    AdamWConfig {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-6,
        weight_decay: 0.1,
    }
}

/// Parameters whose sizes (7, 13, 1, 3×5) share out unevenly over 3 ranks.
fn params() -> BTreeMap<String, Tensor> {
    [
        ("a", vec![7i64]),
        ("b", vec![13]),
        ("c", vec![1]),
        ("d", vec![3, 5]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| {
        let n: i64 = shape.iter().product();
        let t = (Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.1 - i as f64)
            .view(shape.as_slice())
            .set_requires_grad(true);
        (name.to_string(), t)
    })
    .collect()
}

/// Gives each parameter the gradient `g` (through a backward pass).
fn set_grads(params: &BTreeMap<String, Tensor>, grads: &BTreeMap<String, Tensor>) {
    let loss = params
        .iter()
        .map(|(k, p)| (p * &grads[k]).sum(Kind::Float))
        .fold(
            Tensor::zeros([], (Kind::Float, tch::Device::Cpu)),
            |a, b| a + b,
        );
    loss.backward();
}

#[test]
fn zero_shards_update_like_the_whole_adamw_on_summed_gradients() {
    let world = 3;
    let steps = 3;
    // grads[step][rank][param]
    tch::manual_seed(5);
    let grads: Vec<Vec<BTreeMap<String, Vec<f32>>>> = (0..steps)
        .map(|_| {
            (0..world)
                .map(|_| {
                    params()
                        .iter()
                        .map(|(k, p)| {
                            let g = Tensor::randn(p.size(), (Kind::Float, tch::Device::Cpu));
                            (k.clone(), Vec::<f32>::try_from(g.view([-1])).unwrap())
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let to_tensors = |m: &BTreeMap<String, Vec<f32>>, like: &BTreeMap<String, Tensor>| {
        m.iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    Tensor::from_slice(v).view(like[k].size().as_slice()),
                )
            })
            .collect::<BTreeMap<_, _>>()
    };
    // The whole optimizer on the sum of the ranks' gradients, clipped at 1.
    let whole_params = params();
    let mut whole = AdamW::new(
        whole_params
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect(),
        adam(),
    );
    let mut norms = Vec::new();
    for step_grads in &grads {
        whole.zero_grad();
        for rank_grads in step_grads {
            set_grads(&whole_params, &to_tensors(rank_grads, &whole_params));
        }
        norms.push(whole.clip_grad_norm(1.0));
        whole.step();
    }
    let grads = std::sync::Arc::new(grads);
    // Buckets of 16 elements: [a], [b, c], [d]; shards of 64 (aligned), mostly padding.
    let out = on_ranks(world, move |c| {
        let rank = c.rank();
        let ps = params();
        let mut z = ZeroAdamW::new(
            ps.iter()
                .map(|(k, t)| (k.clone(), t.shallow_clone()))
                .collect(),
            adam(),
            Box::new(c),
            16,
            false,
        )
        .unwrap();
        assert_eq!(z.layout().buckets.len(), 3);
        let mut norms = Vec::new();
        for step_grads in grads.iter() {
            z.zero_grad();
            set_grads(&ps, &to_tensors(&step_grads[rank], &ps));
            norms.push(z.clip_grad_norm(1.0).unwrap());
            z.step().unwrap();
            assert!(
                ps.values().all(|p| !p.grad().defined()),
                "the full gradients are dropped once reduced"
            );
        }
        let w: Vec<(String, Vec<f32>)> = ps
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    Vec::<f32>::try_from(t.detach().view([-1])).unwrap(),
                )
            })
            .collect();
        (norms, w)
    });
    for (r, (rank_norms, w)) in out.iter().enumerate() {
        for (a, b) in rank_norms.iter().zip(&norms) {
            assert!((a - b).abs() < 1e-5 * b, "rank {r}: grad norm {a} vs {b}");
        }
        assert!(norms[0] > 1.0, "the gradients were clipped: {norms:?}");
        for (k, v) in w {
            let want: Vec<f64> = Vec::<f32>::try_from(whole_params[k].detach().view([-1]))
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect();
            close(v, &want, &format!("rank {r} {k}"));
        }
        assert_eq!(w, &out[0].1, "rank {r} holds rank 0's weights");
    }
    let moved = (whole_params["b"].detach() - params()["b"].detach())
        .abs()
        .max()
        .double_value(&[]);
    assert!(moved > 0.05, "the weights moved by {moved}");
}

#[test]
fn bad_groups_are_clear_errors() {
    let msg = |e: CollectiveError| e.to_string();
    let e = ThreadCollective::group(0).err().map(msg).unwrap();
    assert!(e.contains("world size must be at least 1, got 0"), "{e}");
    let g = ThreadGroup::new(2).unwrap();
    let e = g.join(2).err().map(msg).unwrap();
    assert!(e.contains("rank 2 is outside a world of 2 ranks"), "{e}");
    let _r0 = g.join(0).unwrap();
    let e = g.join(0).err().map(msg).unwrap();
    assert!(e.contains("rank 0") && e.contains("already taken"), "{e}");

    let id = [0u8; 128];
    let e = NcclCollective::new(0, 0, &id, 0).err().map(msg).unwrap();
    assert!(e.contains("world size must be at least 1"), "{e}");
    let e = NcclCollective::new(3, 2, &id, 0).err().map(msg).unwrap();
    assert!(e.contains("rank 3 is outside a world of 2 ranks"), "{e}");
    let e = NcclCollective::new(0, 2, &id[..5], 0)
        .err()
        .map(msg)
        .unwrap();
    assert!(e.contains("unique id has 5 bytes, expected 128"), "{e}");
    if tch::Cuda::device_count() == 0 {
        // This machine: no GPU, so no NCCL — a reason, not a crash.
        let e = NcclCollective::new(0, 2, &id, 0).err().map(msg).unwrap();
        assert!(e.starts_with("NCCL unavailable: "), "{e}");
        let e = NcclCollective::unique_id().err().map(msg).unwrap();
        assert!(e.starts_with("NCCL unavailable: "), "{e}");
    }
}

#[test]
fn mismatched_calls_and_departed_ranks_fail_instead_of_hanging() {
    let out = on_ranks(2, |c| {
        // Rank 1 sends a longer tensor than rank 0.
        let mut x = Tensor::zeros([3 + c.rank() as i64], (Kind::Float, tch::Device::Cpu));
        c.all_reduce(&mut x, ReduceOp::Sum)
            .err()
            .map(|e| e.to_string())
    });
    for e in &out {
        let e = e.as_deref().unwrap_or("no error");
        assert!(e.contains("ranks disagree"), "{e}");
    }
    // A wrongly sized reduce-scatter is refused before any exchange.
    let c = ThreadCollective::group(1).unwrap().pop().unwrap();
    let mut y = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
    let e = c
        .reduce_scatter(
            &Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)),
            &mut y,
            ReduceOp::Sum,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 elements are not 1 ranks × 2 elements"), "{e}");
    // Rank 1 leaves: rank 0's collective fails rather than waiting forever.
    let mut ranks = ThreadCollective::group(2).unwrap();
    drop(ranks.pop());
    let mut x = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
    let e = ranks[0]
        .all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1 left the group"), "{e}");
}

#[test]
fn a_sharded_optimizer_resumes_from_its_saved_shards() {
    // Two ranks take a step and save their shards; a new group loads them and takes a
    // second step, which must equal the second step of the group that kept going.
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let grads = |rank: usize, step: usize| -> BTreeMap<String, Tensor> {
        params()
            .iter()
            .map(|(k, p)| {
                let g = Tensor::ones(p.size(), (Kind::Float, tch::Device::Cpu))
                    * (1.0 + rank as f64 + 0.5 * step as f64);
                (k.clone(), g)
            })
            .collect()
    };
    let save_dir = dir.clone();
    let kept = on_ranks(2, move |c| {
        let rank = c.rank();
        let ps = params();
        let named = ps
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect();
        let mut z = ZeroAdamW::new(named, adam(), Box::new(c), 16, false).unwrap();
        for step in 0..2 {
            z.zero_grad();
            set_grads(&ps, &grads(rank, step));
            z.step().unwrap();
            if step == 0 {
                z.save(save_dir.path()).unwrap();
            }
        }
        ps.values().map(|t| t.detach().copy()).collect::<Vec<_>>()
    });
    let load_dir = dir.clone();
    let resumed = on_ranks(2, move |c| {
        let rank = c.rank();
        let ps = params();
        let named = ps
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect();
        let mut z = ZeroAdamW::new(named, adam(), Box::new(c), 16, false).unwrap();
        z.load(load_dir.path(), 1).unwrap();
        assert_eq!(z.step_count(), 1);
        z.zero_grad();
        set_grads(&ps, &grads(rank, 1));
        z.step().unwrap();
        ps.values().map(|t| t.detach().copy()).collect::<Vec<_>>()
    });
    for (a, b) in kept.iter().flatten().zip(resumed.iter().flatten()) {
        assert!(a.equal(b), "resumed weights differ");
    }
    // A shard of another layout is refused with the file and the shapes.
    let bad_dir = dir.clone();
    let errors = on_ranks(2, move |c| {
        let ps: BTreeMap<String, Tensor> = [(
            "w".to_string(),
            Tensor::zeros([500], (Kind::Float, tch::Device::Cpu)),
        )]
        .into();
        let mut z = ZeroAdamW::new(ps, adam(), Box::new(c), 16, false).unwrap();
        z.load(bad_dir.path(), 1).unwrap_err()
    });
    for e in errors {
        assert!(
            e.contains("optimizer.rank") && e.contains("expected [256]"),
            "{e}"
        );
    }
}

#[test]
fn many_back_to_back_collectives_stay_in_step() {
    // Ranks race through hundreds of collectives of changing sizes; every result must
    // be the sum of that very call's deposits (a slot reused too early would mix calls).
    let world = 4;
    let out = on_ranks(world, move |c| {
        let mut ok = 0;
        for i in 0..300usize {
            let n = 1 + (i % 7);
            let mut x = Tensor::full(
                [n as i64],
                (c.rank() * 1000 + i) as f64,
                (Kind::Double, tch::Device::Cpu),
            );
            if i % 2 == 0 {
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            } else {
                let mut y = Tensor::zeros([(world * n) as i64], (Kind::Double, tch::Device::Cpu));
                c.all_gather(&x, &mut y).unwrap();
                x = y.sum_dim_intlist(0, false, Kind::Double).view([1]) / n as f64;
            }
            let want = (0..world).map(|r| (r * 1000 + i) as f64).sum::<f64>();
            let got = Vec::<f64>::try_from(x).unwrap();
            ok += usize::from(got.iter().all(|&g| g == want));
        }
        ok
    });
    assert_eq!(out, vec![300; world]);
}

/// Two NCCL ranks on GPUs 0 and 1 (threads of this process, each joining with the
/// other's unique id as the driver's ranks do): reduce-scatter, all-gather, all-reduce
/// and broadcast against plain sums of the same data on the CPU. Each rank's thread
/// leaves its current device at GPU 0 after joining, so a collective that relied on the
/// thread's device instead of the communicator's fails here.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[test]
fn nccl_ranks_on_two_gpus_agree_with_plain_sums() {
    if tch::Cuda::device_count() < 2 {
        eprintln!("skipped: needs two CUDA devices (a two-GPU device machine runs this)");
        return;
    }
    let (world, n) = (2usize, 1000usize);
    let data = random(world, world * n, 21);
    let id = NcclCollective::unique_id().expect("unique id");
    let outs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (id, mine) = (&id, data[rank].clone());
                s.spawn(move || {
                    let c = NcclCollective::new(rank, world, id, rank).expect("join");
                    manta_cuda::set_device(0).expect("set device 0");
                    let dev = c.device();
                    let input = Tensor::from_slice(&mine).to_device(dev);
                    let mut part = Tensor::zeros([n as i64], (Kind::Float, dev));
                    c.reduce_scatter(&input, &mut part, ReduceOp::Sum).unwrap();
                    let mut gathered = Tensor::zeros([(world * n) as i64], (Kind::Float, dev));
                    c.all_gather(&part, &mut gathered).unwrap();
                    let mut reduced = input.copy();
                    c.all_reduce(&mut reduced, ReduceOp::Sum).unwrap();
                    let mut root = input.copy();
                    c.broadcast(&mut root, 1).unwrap();
                    let cpu =
                        |t: &Tensor| Vec::<f32>::try_from(t.to_device(tch::Device::Cpu)).unwrap();
                    (cpu(&part), cpu(&gathered), cpu(&reduced), cpu(&root))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let sum: Vec<f32> = (0..world * n).map(|i| data[0][i] + data[1][i]).collect();
    for (rank, (part, gathered, reduced, root)) in outs.iter().enumerate() {
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5);
        assert!(
            close(part, &sum[rank * n..(rank + 1) * n]),
            "rank {rank}: reduce-scatter"
        );
        assert!(
            close(gathered, &sum),
            "rank {rank}: all-gather of the reduced parts"
        );
        assert!(close(reduced, &sum), "rank {rank}: all-reduce");
        assert_eq!(root, &data[1], "rank {rank}: broadcast from rank 1");
    }
}
