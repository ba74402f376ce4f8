//! Knobs are read in one place: no source file outside crates/knobs names a knob's
//! variable as a string (which is how an ad hoc `std::env::var("MANTA_...")` looks), and
//! the C++ shim calls no `getenv`. Test code may name knobs (to set them for a child).

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if !matches!(
                p.file_name().and_then(|n| n.to_str()),
                Some("target" | "tests" | ".git")
            ) {
                sources(&p, out);
            }
        } else if matches!(
            p.extension().and_then(|x| x.to_str()),
            Some("rs" | "cpp" | "hpp" | "inc" | "cu" | "h")
        ) {
            out.push(p);
        }
    }
}

/// Every place under `root`'s source folders that reads a knob outside crates/knobs.
fn stray_reads(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for top in ["actors", "crates", "bench/src", "proto"] {
        sources(&root.join(top), &mut files);
    }
    let own = root.join("crates/knobs");
    let mut found = Vec::new();
    for f in files.iter().filter(|f| !f.starts_with(&own)) {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let shown = f.strip_prefix(root).unwrap_or(f).display().to_string();
        let test_module = text.find("#[cfg(test)]").unwrap_or(text.len());
        for k in manta_knobs::KNOBS {
            let quoted = format!("\"{}\"", k.name);
            if text[..test_module].contains(&quoted) {
                found.push(format!(
                    "{shown}: names {} (read it through manta_knobs)",
                    k.name
                ));
            }
        }
        let cpp = matches!(
            f.extension().and_then(|x| x.to_str()),
            Some("cpp" | "hpp" | "inc" | "cu" | "h")
        );
        if cpp && text.contains("getenv(") {
            found.push(format!(
                "{shown}: calls getenv (kernel knobs come through manta_knob)"
            ));
        }
    }
    found
}

#[test]
fn no_source_outside_the_registry_reads_a_knob() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let found = stray_reads(&root);
    assert!(
        found.is_empty(),
        "knobs read outside crates/knobs:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_stray_read_is_found() {
    let root = tempfile_dir();
    let src = root.join("actors/x/src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "fn f() -> bool { std::env::var(\"MANTA_PDL\").is_ok() }\n#[cfg(test)]\nmod t { const N: &str = \"MANTA_PAGED_TT\"; }\n",
    )
    .unwrap();
    std::fs::write(
        src.join("shim.cpp"),
        "const char* v = std::getenv(\"X\");\n",
    )
    .unwrap();
    let found = stray_reads(&root);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].contains("MANTA_PDL") || found[1].contains("MANTA_PDL"));
    assert!(found.iter().any(|f| f.contains("getenv")));
    std::fs::remove_dir_all(&root).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "manta-knobs-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// docs/knobs.md carries the table of [`manta_knobs::KNOBS`] exactly.
#[test]
fn the_documented_table_is_the_registry() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/knobs.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    let table = manta_knobs::markdown_table();
    assert!(
        doc.contains(&table),
        "{} does not hold the registry's table; it should contain:\n{table}",
        path.display()
    );
}
