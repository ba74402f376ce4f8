use super::*;
use clap::Parser;

/// A cluster.toml in `dir` that reads the repository's train_config.yaml, with `rest`
/// (more tables) after its `[cluster]` table.
fn local_cluster(dir: &Path, rest: &str) -> std::path::PathBuf {
    let train_config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../train_config.yaml");
    let cluster = dir.join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\ntrain_config = {:?}\n\n{rest}",
            train_config.display().to_string()
        ),
    )
    .unwrap();
    cluster
}

/// `--bf16` means `[trainer] bf16 = true` and wins over the file's `false`.
#[test]
fn bf16_flag_overrides_the_trainer_section() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = local_cluster(dir.path(), "[trainer]\nbf16 = false\n");
    let args = |extra: &[&str]| {
        let mut argv = vec!["driver", "--cluster", cluster.to_str().unwrap()];
        argv.extend_from_slice(extra);
        crate::cli::Cli::try_parse_from(argv).unwrap().train
    };
    let plain = resolve_config(&args(&[])).unwrap();
    assert_eq!(plain.cluster.trainer.bf16, Some(false));
    let flagged = resolve_config(&args(&["--bf16"])).unwrap();
    assert_eq!(flagged.cluster.trainer.bf16, Some(true));
}

/// The resolved-settings listing names each setting's layer: a flag as spelt
/// (Manta's or slime's), a `--train-settings` file, cluster.toml's `[train]`, or the
/// default; the layers win in that order.
#[test]
fn resolved_settings_name_their_sources() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = local_cluster(dir.path(), "[train]\nseed = 7\nlr = 0.5\nn_samples = 3\n");
    let file = dir.path().join("tiny.toml");
    std::fs::write(&file, "[train]\nn_samples = 4\nnum_rollout = 9\n").unwrap();
    let argv = [
        "driver",
        "--cluster",
        cluster.to_str().unwrap(),
        "--train-settings",
        file.to_str().unwrap(),
        "--lr",
        "2e-5",
        "--rollout-temperature",
        "0.7",
    ];
    let mut args = crate::cli::Cli::try_parse_from(argv).unwrap().train;
    let os: Vec<std::ffi::OsString> = argv.iter().map(Into::into).collect();
    args.spellings = crate::settings_report::spellings(&os);
    let resolved = resolve_config(&args).unwrap();
    let list = resolved.layers.resolved(&resolved.settings);
    let get = |key: &str| {
        let s = list.iter().find(|s| s.key == key).unwrap();
        (s.value.clone(), s.source.to_string())
    };
    assert_eq!(get("lr"), (serde_json::json!(2e-5), "flag --lr".into()));
    assert_eq!(
        get("temperature"),
        (
            serde_json::json!(0.7),
            "slime flag --rollout-temperature".into()
        )
    );
    let in_file = format!("{} [train]", file.display());
    assert_eq!(get("n_samples"), (serde_json::json!(4), in_file.clone()));
    assert_eq!(get("num_rollout"), (serde_json::json!(9), in_file));
    let in_cluster = format!("{} [train]", cluster.display());
    assert_eq!(get("seed"), (serde_json::json!(7), in_cluster));
    assert_eq!(
        get("rollout_batch_size"),
        (serde_json::json!(32), "default".into())
    );
    assert_eq!(
        get("max_response_len"),
        (serde_json::json!(4096), "default".into())
    );
}

/// `--context-parallel-size N` needs N local ranks, local mode, ZeRO-2 and no true
/// on-policy mode; 1 (the default) needs nothing.
#[test]
fn context_parallel_size_is_refused_where_it_cannot_run() {
    let check = |text: &str, flags: TrainOverrides| {
        let cluster = ClusterConfig::from_toml_str(text, Path::new("c.toml")).unwrap();
        let settings = flags.over(cluster.train.clone()).unwrap().resolve();
        check_context_parallel(&cluster, &settings, Path::new("c.toml")).map_err(|e| e.to_string())
    };
    let cp = |n: usize| TrainOverrides {
        context_parallel_size: Some(n),
        ..Default::default()
    };
    let two = "[trainer]\ndata_parallel_ranks = 2\n";
    check("", TrainOverrides::default()).unwrap();
    check(two, cp(1)).unwrap();
    check(two, cp(2)).unwrap();
    check(
        "[trainer]\ndata_parallel_ranks = 3\n[train]\ncontext_parallel_size = 3\n",
        TrainOverrides::default(),
    )
    .unwrap();
    for (text, n, ranks) in [
        ("", 2, 1),
        (two, 3, 2),
        ("[trainer]\ndata_parallel_ranks = 4\n", 2, 4),
    ] {
        let err = check(text, cp(n)).unwrap_err();
        assert!(
            err.contains(&format!("--context-parallel-size {n}"))
                && err.contains(&format!("has {ranks}")),
            "{err}"
        );
    }
    let err = check(
        two,
        TrainOverrides {
            zero_stage: Some(3),
            ..cp(2)
        },
    )
    .unwrap_err();
    assert!(
        err.contains("--context-parallel-size 2") && err.contains("--zero-stage 3"),
        "{err}"
    );
    let err = check(
        two,
        TrainOverrides {
            true_on_policy_mode: Some(true),
            ..cp(2)
        },
    )
    .unwrap_err();
    assert!(err.contains("--true-on-policy-mode"), "{err}");
    let err = check(
        "[cluster]\nmode = \"remote\"\n\n[[nodes]]\naddress = \"a:1\"\ngpus = [0, 1]\n",
        cp(2),
    )
    .unwrap_err();
    assert!(
        err.contains("--context-parallel-size 2") && err.contains("remote mode"),
        "{err}"
    );
}

/// `--grad-reduce-in-bf16` needs two ranks or more and bf16 weights.
#[test]
fn grad_reduce_in_bf16_is_refused_for_one_trainer_or_fp32_weights() {
    let check = |text: &str, flag: bool| {
        let cluster = ClusterConfig::from_toml_str(text, Path::new("c.toml")).unwrap();
        let settings = TrainOverrides {
            grad_reduce_in_bf16: flag.then_some(true),
            ..Default::default()
        }
        .over(cluster.train.clone())
        .unwrap()
        .resolve();
        check_grad_reduce_in_bf16(&cluster, &settings, Path::new("c.toml"))
            .map_err(|e| e.to_string())
    };
    check("", false).unwrap();
    check("[trainer]\ngpus = [0, 1]\n", true).unwrap();
    check("[trainer]\ndata_parallel_ranks = 2\nbf16 = true\n", true).unwrap();
    let in_file = "[train]\ngrad_reduce_in_bf16 = true\n";
    check(&format!("{in_file}[trainer]\ngpus = [0, 1]\n"), false).unwrap();
    let err = check("", true).unwrap_err();
    assert!(
        err.contains("--grad-reduce-in-bf16") && err.contains("one trainer"),
        "{err}"
    );
    let err = check(in_file, false).unwrap_err();
    assert!(err.contains("grad_reduce_in_bf16 = true"), "{err}");
    for fp32 in [
        "[trainer]\ndata_parallel_ranks = 2\n",
        "[trainer]\ngpus = [0, 1]\nbf16 = false\n",
    ] {
        let err = check(fp32, true).unwrap_err();
        assert!(
            err.contains("--grad-reduce-in-bf16") && err.contains("fp32"),
            "{fp32}: {err}"
        );
    }
    let remote = "[cluster]\nmode = \"remote\"\n\n[[nodes]]\naddress = \"a:1\"\ngpus = [0]\n\n\
                  [[nodes]]\naddress = \"b:1\"\ngpus = [0]\n\n[trainer]\n";
    check(
        &format!("{remote}ranks = [{{ node = 0, gpu = 0 }}, {{ node = 1, gpu = 0 }}]\n"),
        true,
    )
    .unwrap();
    let err = check(remote, true).unwrap_err();
    assert!(err.contains("one trainer"), "{err}");
}

/// `--zero-stage 3` (or `[train] zero_stage = 3`) needs two local ranks.
#[test]
fn zero_stage_3_is_refused_without_two_local_ranks() {
    let parse = |text: &str| ClusterConfig::from_toml_str(text, Path::new("c.toml")).unwrap();
    let stage = |text: &str, flag: Option<u8>| {
        let cluster = parse(text);
        let settings = TrainOverrides {
            zero_stage: flag,
            ..Default::default()
        }
        .over(cluster.train.clone())
        .unwrap()
        .resolve();
        check_zero_stage(&cluster, &settings, Path::new("c.toml")).map_err(|e| e.to_string())
    };
    stage("", None).unwrap();
    stage("", Some(2)).unwrap();
    stage("[trainer]\ndata_parallel_ranks = 2\n", Some(3)).unwrap();
    let err = stage("", Some(3)).unwrap_err();
    assert!(
        err.contains("--zero-stage 3") && err.contains("has 1"),
        "{err}"
    );
    let err = stage("[train]\nzero_stage = 3\n", None).unwrap_err();
    assert!(
        err.contains("zero_stage = 3") && err.contains("has 1"),
        "{err}"
    );
    let err = stage(
        "[cluster]\nmode = \"remote\"\n\n[[nodes]]\naddress = \"a:1\"\ngpus = [0, 1]\n",
        Some(3),
    )
    .unwrap_err();
    assert!(
        err.contains("--zero-stage 3") && err.contains("remote mode"),
        "{err}"
    );
}
