//! `curves.png`: the per-step curves people watch during GRPO, written beside
//! metrics.jsonl at the end of a run. `train/loss` is left out on purpose: in on-policy
//! GRPO the surrogate loss is ~0 by construction and says nothing about progress.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::{read_metrics, StepMetrics};

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot read metrics {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("no steps with `{metric}` in {path}")]
    Empty { path: String, metric: String },
    #[error("drawing {path}: {message}")]
    Draw { path: String, message: String },
}

/// The panels of the plot, in drawing order: (metric, title).
pub const PLOTTED_METRICS: &[(&str, &str)] = &[
    ("rollout/raw_reward", "reward"),
    ("rollout/response_len/mean", "response length (tokens)"),
    ("train/grad_norm", "grad norm"),
    ("train/entropy_loss", "entropy"),
    ("perf/step_time", "step time (s)"),
];

/// The last panel: the mean reward of each evaluation set (`eval/<name>`).
const EVAL_PANEL_TITLE: &str = "eval reward";

/// The `eval/<name>` metrics (each set's mean reward) the rows hold, by name.
fn eval_reward_metrics(rows: &[(u64, StepMetrics)]) -> Vec<String> {
    let mut names: Vec<String> = rows
        .iter()
        .flat_map(|(_, m)| m.keys())
        .filter(|k| {
            k.strip_prefix("eval/")
                .is_some_and(|name| !name.contains('/') && !name.contains('-'))
        })
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    names
}

/// One series that was drawn: its metric and how many steps it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlottedSeries {
    pub metric: String,
    pub points: usize,
}

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a system font for labels once; without one the plot is drawn unlabeled.
fn register_font() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        for path in FONT_CANDIDATES {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// (step, value) points of `metric`, in file order.
fn series(rows: &[(u64, StepMetrics)], metric: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|(step, m)| m.get(metric).map(|v| (*step as f64, *v)))
        .collect()
}

/// Plots each of [`PLOTTED_METRICS`] against step, one panel each, and each evaluation
/// set's reward in the last panel; returns the series drawn (a metric the run never
/// logged is left blank and not returned).
pub fn plot_curves(metrics_path: &Path, png_path: &Path) -> Result<Vec<PlottedSeries>, PlotError> {
    let rows = read_metrics(metrics_path).map_err(|source| PlotError::Read {
        path: metrics_path.display().to_string(),
        source,
    })?;
    let (reward_metric, _) = PLOTTED_METRICS[0];
    if series(&rows, reward_metric).is_empty() {
        return Err(PlotError::Empty {
            path: metrics_path.display().to_string(),
            metric: reward_metric.into(),
        });
    }
    let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: png_path.display().to_string(),
        message: e.to_string(),
    };
    let labeled = register_font();
    let root = BitMapBackend::new(png_path, (1200, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(&e))?;
    let panels = root.split_evenly((3, 2));
    let colors = [BLUE, RGBColor(0, 140, 0), RED, MAGENTA, BLACK, CYAN];
    // Each panel: its title and its series (one per metric).
    let mut contents: Vec<(String, Vec<String>)> = PLOTTED_METRICS
        .iter()
        .map(|(metric, title)| (format!("{title}  [{metric}]"), vec![metric.to_string()]))
        .collect();
    contents.push((
        format!("{EVAL_PANEL_TITLE}  [eval/<name>]"),
        eval_reward_metrics(&rows),
    ));
    let mut drawn = Vec::new();
    for (panel, (title, metrics)) in panels.iter().zip(contents) {
        let data: Vec<(String, Vec<(f64, f64)>)> = metrics
            .into_iter()
            .map(|m| {
                let points = series(&rows, &m);
                (m, points)
            })
            .filter(|(_, points)| !points.is_empty())
            .collect();
        if data.is_empty() {
            continue;
        }
        let all = || data.iter().flat_map(|(_, p)| p.iter());
        let (x0, x1) = bounds(all().map(|p| p.0));
        let (y0, y1) = bounds(all().map(|p| p.1));
        let mut builder = ChartBuilder::on(panel);
        builder.margin(12);
        if labeled {
            builder
                .caption(title, ("sans-serif", 20))
                .x_label_area_size(35)
                .y_label_area_size(60);
        }
        let mut chart = builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| draw_err(&e))?;
        let mut mesh = chart.configure_mesh();
        let step_label = |x: &f64| format!("{x:.0}");
        if labeled {
            mesh.x_desc("step").x_label_formatter(&step_label);
        } else {
            mesh.disable_x_mesh()
                .disable_y_mesh()
                .x_labels(0)
                .y_labels(0);
        }
        mesh.draw().map_err(|e| draw_err(&e))?;
        let several = data.len() > 1;
        for (i, (metric, points)) in data.iter().enumerate() {
            let color = colors[(drawn.len() + i) % colors.len()];
            let line = chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| draw_err(&e))?;
            if several && labeled {
                line.label(metric.as_str()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            }
        }
        if several && labeled {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .draw()
                .map_err(|e| draw_err(&e))?;
        }
        drawn.extend(data.into_iter().map(|(metric, points)| PlottedSeries {
            metric,
            points: points.len(),
        }));
    }
    root.present().map_err(|e| draw_err(&e))?;
    Ok(drawn)
}

/// A padded [min, max] range that is never empty.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let pad = ((hi - lo) * 0.05).max(1e-3);
    (lo - pad, hi + pad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{MetricsWriter, StepMetrics};

    /// Twenty steps with every metric a trainer logs, loss included.
    fn write_run(path: &Path, with_entropy: bool) {
        let mut w = MetricsWriter::open(path).unwrap();
        for step in 1..=20u64 {
            let s = step as f64;
            let mut m = StepMetrics::new();
            m.insert("rollout/raw_reward".into(), s / 20.0);
            m.insert("rollout/response_len/mean".into(), 8.0 - s / 10.0);
            m.insert("train/grad_norm".into(), 1.0 / s);
            m.insert("train/loss".into(), 0.0);
            m.insert("train/pg_loss".into(), 0.0);
            if with_entropy {
                m.insert("train/entropy_loss".into(), 5.0 - s / 10.0);
            }
            m.insert("perf/step_time".into(), 0.4);
            w.write_step(step, &m).unwrap();
        }
    }

    #[test]
    fn plots_what_grpo_users_watch_and_not_the_loss() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        write_run(&metrics, true);
        let png = dir.path().join("curves.png");
        let drawn = plot_curves(&metrics, &png).unwrap();
        let names: Vec<&str> = drawn.iter().map(|s| s.metric.as_str()).collect();
        assert_eq!(
            names,
            [
                "rollout/raw_reward",
                "rollout/response_len/mean",
                "train/grad_norm",
                "train/entropy_loss",
                "perf/step_time"
            ]
        );
        assert!(!names.contains(&"train/loss"));
        assert!(drawn.iter().all(|s| s.points == 20), "{drawn:?}");
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 5000, "{} bytes", bytes.len());
    }

    #[test]
    fn evaluation_rewards_share_the_last_panel() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        write_run(&metrics, true);
        let mut w = MetricsWriter::open(&metrics).unwrap();
        for step in [0u64, 10, 20] {
            let m = StepMetrics::from([
                ("eval/math".to_string(), step as f64 / 20.0),
                ("eval/code".to_string(), 0.5),
                ("eval/code/truncated_ratio".to_string(), 0.0),
                ("eval/code-pass@1".to_string(), 0.5),
            ]);
            w.write_step(step, &m).unwrap();
        }
        let drawn = plot_curves(&metrics, &dir.path().join("p.png")).unwrap();
        let eval: Vec<(&str, usize)> = drawn
            .iter()
            .filter(|s| s.metric.starts_with("eval/"))
            .map(|s| (s.metric.as_str(), s.points))
            .collect();
        assert_eq!(eval, [("eval/code", 3), ("eval/math", 3)]);
        // The step rows of the same steps still plot once each.
        assert!(drawn
            .iter()
            .any(|s| s.metric == "rollout/raw_reward" && s.points == 20));
    }

    #[test]
    fn a_metric_the_run_never_logged_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        write_run(&metrics, false);
        let drawn = plot_curves(&metrics, &dir.path().join("p.png")).unwrap();
        assert_eq!(drawn.len(), 4);
        assert!(drawn.iter().all(|s| s.metric != "train/entropy_loss"));
    }

    #[test]
    fn empty_metrics_is_an_error_naming_the_metric() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, "").unwrap();
        let err = plot_curves(&metrics, &dir.path().join("p.png")).unwrap_err();
        assert!(err.to_string().contains("rollout/raw_reward"));
    }
}
