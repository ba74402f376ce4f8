//! A PNG of reward and loss per step, written beside metrics.jsonl at the end of a run.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::read_metrics;

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

/// Plots `rollout/raw_reward` (top) and `train/loss` (bottom) against step.
pub fn plot_reward_and_loss(metrics_path: &Path, png_path: &Path) -> Result<(), PlotError> {
    let rows = read_metrics(metrics_path).map_err(|source| PlotError::Read {
        path: metrics_path.display().to_string(),
        source,
    })?;
    let series = |name: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|(step, m)| m.get(name).map(|v| (*step as f64, *v)))
            .collect()
    };
    let reward = series("rollout/raw_reward");
    let loss = series("train/loss");
    if reward.is_empty() {
        return Err(PlotError::Empty {
            path: metrics_path.display().to_string(),
            metric: "rollout/raw_reward".into(),
        });
    }
    let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: png_path.display().to_string(),
        message: e.to_string(),
    };
    let labeled = register_font();
    let root = BitMapBackend::new(png_path, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(&e))?;
    let panels = root.split_evenly((2, 1));
    for (panel, (name, data, color)) in panels.iter().zip([
        ("rollout/raw_reward", &reward, BLUE),
        ("train/loss", &loss, RED),
    ]) {
        if data.is_empty() {
            continue;
        }
        let (x0, x1) = bounds(data.iter().map(|p| p.0));
        let (y0, y1) = bounds(data.iter().map(|p| p.1));
        let mut builder = ChartBuilder::on(panel);
        builder.margin(12);
        if labeled {
            builder
                .caption(name, ("sans-serif", 22))
                .x_label_area_size(35)
                .y_label_area_size(60);
        }
        let mut chart = builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| draw_err(&e))?;
        let mut mesh = chart.configure_mesh();
        if labeled {
            mesh.x_desc("step");
        } else {
            mesh.disable_x_mesh()
                .disable_y_mesh()
                .x_labels(0)
                .y_labels(0);
        }
        mesh.draw().map_err(|e| draw_err(&e))?;
        chart
            .draw_series(LineSeries::new(data.iter().copied(), color.stroke_width(2)))
            .map_err(|e| draw_err(&e))?;
    }
    root.present().map_err(|e| draw_err(&e))?;
    Ok(())
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

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&metrics).unwrap();
        for step in 1..=20u64 {
            let mut m = StepMetrics::new();
            m.insert("rollout/raw_reward".into(), step as f64 / 20.0);
            m.insert("train/loss".into(), 1.0 / step as f64);
            w.write_step(step, &m).unwrap();
        }
        let png = dir.path().join("plot.png");
        plot_reward_and_loss(&metrics, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 2000);
    }

    #[test]
    fn empty_metrics_is_an_error_naming_the_metric() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, "").unwrap();
        let err = plot_reward_and_loss(&metrics, &dir.path().join("p.png")).unwrap_err();
        assert!(err.to_string().contains("rollout/raw_reward"));
    }
}
