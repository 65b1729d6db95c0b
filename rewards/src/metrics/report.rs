//! Aggregation of per-example metrics per data source, as JSON and as a table.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::ExampleMetrics;

/// Means ×100 of one data source (or of all of them) and how many examples they cover.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MetricsRow {
    /// Number of examples.
    pub n: usize,
    /// Mean exact match ×100.
    pub em: f64,
    /// Mean substring match ×100.
    pub sm: f64,
    /// Mean token F1 ×100.
    pub f1: f64,
    /// Mean SSim ×100; absent when no similarity model was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssim: Option<f64>,
}

/// Metrics per data source and overall.
///
/// JSON: `{"datasets": {"<data_source>": {"n", "em", "sm", "f1", "ssim"?}}, "overall": {…}}`.
/// `overall` is the unweighted mean of the per-dataset means (the paper's "Avg." column),
/// with `n` the total number of examples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsReport {
    /// One row per data source, sorted by name.
    pub datasets: BTreeMap<String, MetricsRow>,
    /// Mean over the data sources.
    pub overall: MetricsRow,
}

/// Running sums of one data source; `ssim` turns `None` at the first example without SSim.
struct Sums {
    n: usize,
    em: f64,
    sm: f64,
    f1: f64,
    ssim: Option<f64>,
}

impl Default for Sums {
    fn default() -> Self {
        Self {
            n: 0,
            em: 0.0,
            sm: 0.0,
            f1: 0.0,
            ssim: Some(0.0),
        }
    }
}

impl Sums {
    fn add(&mut self, m: &ExampleMetrics) {
        self.n += 1;
        self.em += m.em;
        self.sm += m.sm;
        self.f1 += m.f1;
        self.ssim = self.ssim.zip(m.ssim).map(|(sum, s)| sum + s);
    }

    fn row(&self) -> MetricsRow {
        let mean = |sum: f64| 100.0 * sum / self.n as f64;
        MetricsRow {
            n: self.n,
            em: mean(self.em),
            sm: mean(self.sm),
            f1: mean(self.f1),
            ssim: self.ssim.map(mean),
        }
    }
}

impl MetricsReport {
    /// Aggregates `(data_source, metrics)` pairs. A data source has an SSim mean only when
    /// every one of its examples has an SSim; `overall` has one when every data source does.
    pub fn from_examples<I>(examples: I) -> Self
    where
        I: IntoIterator<Item = (String, ExampleMetrics)>,
    {
        let mut sums: BTreeMap<String, Sums> = BTreeMap::new();
        for (source, metrics) in examples {
            sums.entry(source).or_default().add(&metrics);
        }
        let datasets: BTreeMap<String, MetricsRow> = sums
            .into_iter()
            .map(|(source, s)| (source, s.row()))
            .collect();
        let overall = macro_average(datasets.values());
        Self { datasets, overall }
    }
}

/// Unweighted mean of the rows' means; `n` is the total. All zeros when there are no rows.
fn macro_average<'a>(rows: impl ExactSizeIterator<Item = &'a MetricsRow> + Clone) -> MetricsRow {
    let count = rows.len();
    let mean = |field: fn(&MetricsRow) -> f64| {
        if count == 0 {
            0.0
        } else {
            rows.clone().map(field).sum::<f64>() / count as f64
        }
    };
    let ssim = rows
        .clone()
        .map(|row| row.ssim)
        .collect::<Option<Vec<f64>>>()
        .filter(|all| !all.is_empty())
        .map(|all| all.iter().sum::<f64>() / all.len() as f64);
    MetricsRow {
        n: rows.clone().map(|row| row.n).sum(),
        em: mean(|row| row.em),
        sm: mean(|row| row.sm),
        f1: mean(|row| row.f1),
        ssim,
    }
}

impl fmt::Display for MetricsReport {
    /// A fixed-width table: one line per data source, then `overall`; the SSim column only
    /// when SSim was computed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let with_ssim = self.overall.ssim.is_some();
        let name_width = self
            .datasets
            .keys()
            .map(|name| name.chars().count())
            .chain(["data_source".len(), "overall".len()])
            .max()
            .unwrap_or_default();
        write!(
            f,
            "{:<name_width$} {:>6} {:>7} {:>7} {:>7}",
            "data_source", "n", "EM", "SM", "F1"
        )?;
        if with_ssim {
            write!(f, " {:>7}", "SSim")?;
        }
        writeln!(f)?;
        let rows = self
            .datasets
            .iter()
            .map(|(name, row)| (name.as_str(), row))
            .chain([("overall", &self.overall)]);
        for (name, row) in rows {
            write!(
                f,
                "{name:<name_width$} {:>6} {:>7.2} {:>7.2} {:>7.2}",
                row.n, row.em, row.sm, row.f1
            )?;
            if let (true, Some(ssim)) = (with_ssim, row.ssim) {
                write!(f, " {ssim:>7.2}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(em: f64, sm: f64, f1: f64, ssim: Option<f64>) -> ExampleMetrics {
        ExampleMetrics { em, sm, f1, ssim }
    }

    #[test]
    fn means_per_source_and_macro_overall() {
        let report = MetricsReport::from_examples([
            ("a".to_string(), m(1.0, 1.0, 1.0, None)),
            ("a".to_string(), m(0.0, 1.0, 0.5, None)),
            ("b".to_string(), m(0.0, 0.0, 0.25, None)),
        ]);
        let a = report.datasets["a"];
        // a: EM (1+0)/2 = 50, SM (1+1)/2 = 100, F1 (1+0.5)/2 = 75.
        assert_eq!(
            (a.n, a.em, a.sm, a.f1, a.ssim),
            (2, 50.0, 100.0, 75.0, None)
        );
        let b = report.datasets["b"];
        assert_eq!((b.n, b.em, b.sm, b.f1), (1, 0.0, 0.0, 25.0));
        // overall: mean of the two sources' means; n = 3.
        let o = report.overall;
        assert_eq!((o.n, o.em, o.sm, o.f1, o.ssim), (3, 25.0, 50.0, 50.0, None));
    }

    #[test]
    fn ssim_mean_only_when_every_example_has_one() {
        let report = MetricsReport::from_examples([
            ("a".to_string(), m(0.0, 0.0, 0.0, Some(0.5))),
            ("a".to_string(), m(0.0, 0.0, 0.0, Some(1.0))),
            ("b".to_string(), m(0.0, 0.0, 0.0, Some(0.2))),
            ("b".to_string(), m(0.0, 0.0, 0.0, None)),
        ]);
        assert_eq!(report.datasets["a"].ssim, Some(75.0));
        assert_eq!(report.datasets["b"].ssim, None);
        assert_eq!(report.overall.ssim, None);
    }

    #[test]
    fn json_shape() {
        let report =
            MetricsReport::from_examples([("hotpot".to_string(), m(1.0, 1.0, 0.5, Some(0.75)))]);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "datasets": {"hotpot": {"n": 1, "em": 100.0, "sm": 100.0, "f1": 50.0, "ssim": 75.0}},
                "overall": {"n": 1, "em": 100.0, "sm": 100.0, "f1": 50.0, "ssim": 75.0}
            })
        );
        let without = MetricsReport::from_examples([("x".to_string(), m(0.0, 0.0, 0.0, None))]);
        let json = serde_json::to_value(&without).unwrap();
        assert!(json["datasets"]["x"].get("ssim").is_none());
        assert!(json["overall"].get("ssim").is_none());
    }

    #[test]
    fn table_has_a_line_per_source_and_ssim_only_when_present() {
        let report = MetricsReport::from_examples([
            ("long_source_name".to_string(), m(1.0, 1.0, 1.0, Some(0.5))),
            ("b".to_string(), m(0.0, 0.0, 0.5, Some(1.0))),
        ]);
        let table = report.to_string();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("data_source") && lines[0].ends_with("SSim"));
        assert!(lines[1].starts_with("b ") && lines[1].ends_with("100.00"));
        assert!(lines[2].starts_with("long_source_name"));
        assert!(lines[3].starts_with("overall"));
        // overall F1 = (100 + 50) / 2 = 75, SSim = (50 + 100) / 2 = 75.
        assert!(lines[3].contains("75.00"));
        let plain =
            MetricsReport::from_examples([("x".to_string(), m(0.0, 0.0, 0.0, None))]).to_string();
        assert!(!plain.contains("SSim"));
    }
}
