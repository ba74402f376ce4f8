//! docs/cli.md against the binaries' `--help`: every long flag a command prints must be in
//! the flag table of that command's section, and every flag in a table must be one the
//! command prints. Sections are the `## `cmd`` headings; a flag counts when it is in the
//! first column of a table row (`| `--flag VALUE` | … |`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const DRIVER: &str = env!("CARGO_BIN_EXE_driver");
const WORKER: &str = env!("CARGO_BIN_EXE_worker");

/// Printed by every command; not documented per command.
const GENERIC: [&str; 2] = ["--help", "--version"];

fn help(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{bin} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// Long flags of clap's help: option lines start (after at most 6 spaces) with `-x, --flag`
/// or `--flag`; description lines are indented further.
fn help_flags(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        if indent == 0 || indent > 6 || !trimmed.starts_with('-') {
            continue;
        }
        let first_long = trimmed
            .split_whitespace()
            .map(|t| t.trim_end_matches(','))
            .find(|t| t.starts_with("--"));
        if let Some(flag) = first_long {
            if !GENERIC.contains(&flag) {
                flags.insert(flag.to_string());
            }
        }
    }
    flags
}

/// Subcommands listed under `Commands:` in the top-level help, `help` left out.
fn subcommands(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect()
}

/// `--flag` tokens in `s`.
fn long_flags(s: &str) -> impl Iterator<Item = String> + '_ {
    s.match_indices("--").filter_map(move |(i, _)| {
        let rest = &s[i + 2..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .unwrap_or(rest.len());
        let before_ok = i == 0 || !s[..i].ends_with(|c: char| c.is_ascii_alphanumeric());
        let starts_ok = rest.starts_with(|c: char| c.is_ascii_alphanumeric());
        (before_ok && starts_ok).then(|| format!("--{}", &rest[..end]))
    })
}

/// The flags in the first column of the tables of the section headed `## `cmd``
/// (up to the next `## ` heading), or None when the page has no such section.
fn doc_flags(doc: &str, cmd: &str) -> Option<BTreeSet<String>> {
    let heading = format!("## `{cmd}`");
    let mut lines = doc.lines();
    lines.find(|l| *l == heading || l.starts_with(&format!("{heading} ")))?;
    let mut flags = BTreeSet::new();
    let mut in_code = false;
    for line in lines {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        if line.starts_with("## ") {
            break;
        }
        if let Some(row) = line.strip_prefix('|') {
            let first_cell = row.split('|').next().unwrap_or("");
            flags.extend(long_flags(first_cell));
        }
    }
    Some(flags)
}

fn list(flags: &BTreeSet<String>) -> String {
    flags.iter().cloned().collect::<Vec<_>>().join(", ")
}

#[test]
fn cli_reference_matches_the_help_of_every_command() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cli.md");
    let doc = std::fs::read_to_string(&doc_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", doc_path.display()));

    // (section in docs/cli.md, binary, help invocations whose flags that section lists)
    let mut commands: Vec<(String, &str, Vec<Vec<String>>)> = vec![
        (
            "driver".into(),
            DRIVER,
            vec![vec!["--help".into()], vec!["train".into(), "--help".into()]],
        ),
        ("worker".into(), WORKER, vec![vec!["--help".into()]]),
    ];
    let top = help(DRIVER, &["--help"]);
    let subs = subcommands(&top);
    assert!(
        subs.iter().any(|s| s == "train"),
        "no `train` under Commands: in `driver --help`:\n{top}"
    );
    for sub in subs.iter().filter(|s| *s != "train") {
        commands.push((
            format!("driver {sub}"),
            DRIVER,
            vec![vec![sub.clone(), "--help".into()]],
        ));
    }

    let mut problems = Vec::new();
    for (section, bin, invocations) in &commands {
        let Some(documented) = doc_flags(&doc, section) else {
            problems.push(format!(
                "docs/cli.md has no section \"## `{section}`\" (a command without a flag reference)"
            ));
            continue;
        };
        for args in invocations {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let shown = help_flags(&help(bin, &args));
            let name = Path::new(bin).file_name().unwrap().to_string_lossy();
            let invocation = format!("{name} {}", args.join(" "));
            assert!(!shown.is_empty(), "no flags found in `{invocation}`");
            let missing: BTreeSet<_> = shown.difference(&documented).cloned().collect();
            let stale: BTreeSet<_> = documented.difference(&shown).cloned().collect();
            if !missing.is_empty() {
                problems.push(format!(
                    "`{invocation}` prints flags missing from the tables of docs/cli.md \"## `{section}`\": {}",
                    list(&missing)
                ));
            }
            if !stale.is_empty() {
                problems.push(format!(
                    "docs/cli.md \"## `{section}`\" lists flags that `{invocation}` does not print: {}",
                    list(&stale)
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn help_parsing_finds_long_flags_only() {
    let text = "Options:\n      --cluster <CLUSTER>\n          Cluster description [--x]\n  \
                -h, --help\n          Print help\n      --tp-size <N>  Only 1 [alias: --tensor-parallel-size]\n";
    let flags = help_flags(text);
    assert_eq!(list(&flags), "--cluster, --tp-size");
    let doc = "## `driver`\n\n| flag | meaning |\n|---|---|\n| `--lr LR` | rate, see --min-lr |\n\
               | `--adam-beta1 B` | beta |\n\n```\n| `--not-a-row` |\n```\n## `driver serve`\n| `--port P` | p |\n";
    assert_eq!(
        list(&doc_flags(doc, "driver").unwrap()),
        "--adam-beta1, --lr"
    );
    assert_eq!(list(&doc_flags(doc, "driver serve").unwrap()), "--port");
    assert!(doc_flags(doc, "worker").is_none());
}

/// docs/migration.md names only flags that exist: Manta's (in `driver --help` or
/// `driver prepare-tasks --help`, aliases included) or slime's that the driver knows
/// (ignored, one-value or refused), so the page cannot drift from the binary.
#[test]
fn migration_page_names_only_flags_the_driver_knows() {
    use manta_driver::slime_args::{IGNORED, ONE_VALUE, UNSUPPORTED};
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/migration.md"),
    )
    .expect("docs/migration.md");
    let help_text = format!(
        "{}\n{}",
        help(DRIVER, &["--help"]),
        help(DRIVER, &["prepare-tasks", "--help"])
    );
    let manta: BTreeSet<String> = long_flags(&help_text).collect();
    let slime: BTreeSet<&str> = IGNORED
        .iter()
        .map(|e| e.flag)
        .chain(ONE_VALUE.iter().map(|e| e.flag))
        .chain(UNSUPPORTED.iter().map(|e| e.flag))
        .collect();
    let mut unknown = Vec::new();
    for flag in long_flags(&doc) {
        let known = if flag.ends_with('-') {
            // A family such as `--sglang-speculative-*`.
            slime.iter().any(|s| s.starts_with(&flag))
        } else {
            manta.contains(&flag) || slime.contains(flag.as_str())
        };
        if !known {
            unknown.push(flag);
        }
    }
    assert!(
        unknown.is_empty(),
        "docs/migration.md names unknown flags: {unknown:?}"
    );
    // The page covers every refused flag.
    for e in UNSUPPORTED {
        let covered = doc.contains(e.flag)
            || (e.flag.starts_with("--sglang-speculative-")
                && doc.contains("--sglang-speculative-*"));
        assert!(
            covered,
            "docs/migration.md does not name refused {}",
            e.flag
        );
    }
}
