//! Line charts laid out as a grid of panels: nice axis ticks, number labels, series drawn as
//! lines or points, an optional shaded band and an optional right-hand axis.

use super::canvas::{Canvas, Rect, Rgb};

pub const WHITE: Rgb = [255, 255, 255];
pub const INK: Rgb = [34, 34, 34];
pub const AXIS: Rgb = [90, 90, 90];
pub const GRID: Rgb = [215, 215, 215];
pub const MUTED: Rgb = [150, 150, 150];
pub const BLUE: Rgb = [31, 119, 180];
pub const ORANGE: Rgb = [255, 127, 14];
pub const GREEN: Rgb = [44, 160, 44];
pub const RED: Rgb = [214, 39, 40];
pub const PURPLE: Rgb = [148, 103, 189];
pub const BROWN: Rgb = [140, 86, 75];
pub const LIGHT_BLUE: Rgb = [198, 219, 239];

/// A linear map from a data interval `[d0, d1]` onto a pixel interval `[p0, p1]` (either may
/// be decreasing: y grows downwards in pixels).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    d0: f64,
    d1: f64,
    p0: f64,
    p1: f64,
}

impl Scale {
    pub fn new(d0: f64, d1: f64, p0: f64, p1: f64) -> Self {
        Self { d0, d1, p0, p1 }
    }

    pub fn map(&self, v: f64) -> f64 {
        if self.d1 == self.d0 {
            return (self.p0 + self.p1) / 2.0;
        }
        self.p0 + (v - self.d0) / (self.d1 - self.d0) * (self.p1 - self.p0)
    }

    /// `map`, rounded to a pixel.
    pub fn px(&self, v: f64) -> i32 {
        self.map(v).round() as i32
    }
}

/// An axis range rounded out to "nice" numbers, and its ticks (`lo` and `hi` included).
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub step: f64,
    pub ticks: Vec<f64>,
}

/// A step of 1, 2 or 5 × 10^k close to `raw`, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 + 1e-9 {
        1.0
    } else if norm <= 2.0 + 1e-9 {
        2.0
    } else if norm <= 5.0 + 1e-9 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// About `target` intervals covering `[min, max]`, with ends on multiples of the step.
/// `integer` keeps the step a whole number (for step counts). A point range is widened.
pub fn nice_axis(min: f64, max: f64, target: usize, integer: bool) -> Axis {
    let (mut min, mut max) = if min.is_finite() && max.is_finite() && min <= max {
        (min, max)
    } else {
        (0.0, 1.0)
    };
    if max - min <= f64::EPSILON * min.abs().max(max.abs()) {
        if integer {
            min -= 1.0;
            max += 1.0;
        } else if min == 0.0 {
            max = 1.0;
        } else {
            let d = min.abs() * 0.1;
            min -= d;
            max += d;
        }
    }
    let mut step = nice_step((max - min) / target.max(1) as f64);
    if integer {
        step = step.max(1.0).round();
    }
    let lo = (min / step + 1e-9).floor() * step;
    let hi = (max / step - 1e-9).ceil() * step;
    let n = ((hi - lo) / step).round().max(1.0) as usize;
    let ticks = (0..=n).map(|i| lo + i as f64 * step).collect();
    Axis {
        lo,
        hi: lo + n as f64 * step,
        step,
        ticks,
    }
}

/// Fewest decimals (up to 8) that write multiples of `step` exactly.
fn decimals_for(step: f64) -> usize {
    for d in 0..=8 {
        let s = step * 10f64.powi(d as i32);
        if (s - s.round()).abs() < 1e-6 * s.abs().max(1.0) {
            return d;
        }
    }
    8
}

/// A tick label for `v` on an axis with this `step` and largest magnitude `max_abs`: plain
/// decimals, or `2.5e-4` style when the numbers are very large or very small.
pub fn format_tick(v: f64, step: f64, max_abs: f64) -> String {
    let v = if v.abs() < step.abs() * 1e-6 { 0.0 } else { v };
    if v == 0.0 {
        return "0".into();
    }
    let text = if max_abs >= 1e5 || max_abs < 1e-3 {
        let e = max_abs.log10().floor() as i32;
        let scale = 10f64.powi(e);
        format!("{:.*}e{e}", decimals_for(step / scale), v / scale)
    } else {
        format!("{:.*}", decimals_for(step), v)
    };
    match text.strip_prefix('-') {
        Some(rest) if rest.chars().all(|c| c == '0' || c == '.') => rest.into(),
        _ => text,
    }
}

fn tick_labels(axis: &Axis) -> Vec<String> {
    let max_abs = axis.lo.abs().max(axis.hi.abs());
    axis.ticks
        .iter()
        .map(|&t| format_tick(t, axis.step, max_abs))
        .collect()
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Consecutive values joined by a line (an isolated value gets a marker).
    Line,
    /// A marker per value.
    Points,
}

/// One named series, aligned with the panel's x values; `None` or non-finite values are gaps.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: Rgb,
    pub style: Style,
    pub values: Vec<Option<f64>>,
}

impl Series {
    pub fn new(name: &str, color: Rgb, style: Style, values: Vec<Option<f64>>) -> Self {
        Self {
            name: name.into(),
            color,
            style,
            values,
        }
    }

    fn value(&self, i: usize) -> Option<f64> {
        self.values
            .get(i)
            .copied()
            .flatten()
            .filter(|v| v.is_finite())
    }

    fn has_data(&self) -> bool {
        (0..self.values.len()).any(|i| self.value(i).is_some())
    }
}

/// A shaded region between two series (e.g. mean ± std), drawn under the lines.
#[derive(Debug, Clone)]
pub struct Band {
    pub name: String,
    pub color: Rgb,
    pub lo: Vec<Option<f64>>,
    pub hi: Vec<Option<f64>>,
}

impl Band {
    fn at(&self, i: usize) -> Option<(f64, f64)> {
        let lo = self
            .lo
            .get(i)
            .copied()
            .flatten()
            .filter(|v| v.is_finite())?;
        let hi = self
            .hi
            .get(i)
            .copied()
            .flatten()
            .filter(|v| v.is_finite())?;
        Some((lo, hi))
    }
}

/// One chart: x values, series on the left axis, optionally series on a right axis (drawn
/// in their own scale, labelled in their colour) and a band on the left axis.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub xs: Vec<f64>,
    pub left: Vec<Series>,
    pub right: Vec<Series>,
    pub band: Option<Band>,
}

impl Panel {
    pub fn new(title: &str, xs: Vec<f64>) -> Self {
        Self {
            title: title.into(),
            xs,
            left: Vec::new(),
            right: Vec::new(),
            band: None,
        }
    }

    pub fn left(mut self, series: Series) -> Self {
        self.left.push(series);
        self
    }

    pub fn right(mut self, series: Series) -> Self {
        self.right.push(series);
        self
    }

    pub fn band(mut self, band: Band) -> Self {
        self.band = Some(band);
        self
    }

    /// Whether any series has a finite value (otherwise the panel says "n/a").
    pub fn has_data(&self) -> bool {
        self.left.iter().chain(&self.right).any(Series::has_data)
    }

    fn x_range(&self) -> Option<(f64, f64)> {
        min_max(self.xs.iter().copied())
    }

    fn y_range(series: &[Series], band: Option<&Band>) -> Option<(f64, f64)> {
        let n = series.iter().map(|s| s.values.len()).max().unwrap_or(0);
        let values = series
            .iter()
            .flat_map(|s| (0..n).filter_map(move |i| s.value(i)));
        let band_values = band
            .into_iter()
            .flat_map(|b| (0..b.lo.len().max(b.hi.len())).filter_map(move |i| b.at(i)))
            .flat_map(|(lo, hi)| [lo, hi]);
        min_max(values.chain(band_values))
    }
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

/// Text sizes (integer pixel scales of the 5×7 font).
#[derive(Debug, Clone, Copy)]
struct Fonts {
    title: i32,
    label: i32,
}

const TICK: i32 = 4;
const GAP: i32 = 4;

/// A whole figure: a title line and panels in a grid of `cols` columns.
pub struct Figure {
    pub title: String,
    pub cols: usize,
    pub panels: Vec<Panel>,
}

impl Figure {
    /// Draws the figure onto a `width`×`height` white canvas.
    pub fn render(&self, width: u32, height: u32) -> Canvas {
        let mut canvas = Canvas::new(width, height, WHITE);
        let cols = self.cols.max(1);
        let rows = self.panels.len().div_ceil(cols).max(1);
        let (w, h) = (width as i32, height as i32);
        let big = w / cols as i32 >= 420 && h / rows as i32 >= 260;
        let fonts = if big {
            Fonts { title: 2, label: 2 }
        } else {
            Fonts { title: 1, label: 1 }
        };
        let header = if self.title.is_empty() {
            0
        } else {
            Canvas::text_height(fonts.title) + 12
        };
        if header > 0 {
            canvas.text(12, 8, &self.title, INK, fonts.title);
            canvas.line(0, header - 3, w - 1, header - 3, GRID);
        }
        let cell_w = w / cols as i32;
        let cell_h = (h - header) / rows as i32;
        for (k, panel) in self.panels.iter().enumerate() {
            let (r, c) = ((k / cols) as i32, (k % cols) as i32);
            let cell = Rect::new(c * cell_w, header + r * cell_h, cell_w, cell_h);
            draw_panel(&mut canvas, cell, panel, fonts);
        }
        canvas
    }
}

fn draw_panel(canvas: &mut Canvas, cell: Rect, panel: &Panel, fonts: Fonts) {
    let pad = 6 + 4 * fonts.label;
    let title_h = Canvas::text_height(fonts.title);
    canvas.text(cell.x + pad, cell.y + pad, &panel.title, INK, fonts.title);
    let label_h = Canvas::text_height(fonts.label);
    let top = cell.y + pad + title_h + 4 + 3 * fonts.label;

    let x_range = panel.x_range();
    let left_range = Panel::y_range(&panel.left, panel.band.as_ref());
    if !panel.has_data() || x_range.is_none() || left_range.is_none() && panel.right.is_empty() {
        let plot = Rect::new(
            cell.x + pad + 4 * fonts.label * 6,
            top,
            cell.w - 2 * pad - 4 * fonts.label * 6,
            cell.bottom() - pad - label_h - TICK - GAP - top,
        );
        canvas.stroke_rect(plot, MUTED);
        let s = fonts.title * 2;
        let text = "n/a";
        let tx = plot.x + (plot.w - Canvas::text_width(text, s)) / 2;
        let ty = plot.y + (plot.h - 7 * s) / 2;
        canvas.text(tx, ty, text, MUTED, s);
        return;
    }
    let (x_min, x_max) = x_range.unwrap();
    let x_axis = nice_axis(x_min, x_max, 6, true);
    let left_axis = left_range.map(|(lo, hi)| nice_axis(lo, hi, 5, false));
    let right_axis = Panel::y_range(&panel.right, None).map(|(lo, hi)| nice_axis(lo, hi, 5, false));
    let left_labels = left_axis.as_ref().map(tick_labels).unwrap_or_default();
    let right_labels = right_axis.as_ref().map(tick_labels).unwrap_or_default();
    let x_labels = tick_labels(&x_axis);
    let widest = |labels: &[String]| {
        labels
            .iter()
            .map(|l| Canvas::text_width(l, fonts.label))
            .max()
            .unwrap_or(0)
    };
    let left_w = widest(&left_labels).max(Canvas::text_width("0.0", fonts.label));
    let right_w = if right_axis.is_some() {
        widest(&right_labels) + TICK + GAP
    } else {
        0
    };
    let plot = Rect::new(
        cell.x + pad + left_w + TICK + GAP,
        top,
        cell.w - 2 * pad - left_w - TICK - GAP - right_w,
        cell.bottom() - pad - label_h - TICK - GAP - top,
    );
    if plot.w < 10 || plot.h < 10 {
        return;
    }
    let xs = Scale::new(
        x_axis.lo,
        x_axis.hi,
        plot.x as f64,
        (plot.right() - 1) as f64,
    );
    let y_scale = |a: &Axis| Scale::new(a.lo, a.hi, (plot.bottom() - 1) as f64, plot.y as f64);

    // Frame, grid inside it, then the data clipped to the plot (over the frame, so that values
    // on the edge of the range stay visible).
    canvas.stroke_rect(plot, AXIS);
    canvas.set_clip(Some(Rect::new(
        plot.x + 1,
        plot.y + 1,
        plot.w - 2,
        plot.h - 2,
    )));
    for &t in &x_axis.ticks {
        canvas.dotted_vline(xs.px(t), plot.y, plot.bottom() - 1, 2, GRID);
    }
    if let Some(a) = &left_axis {
        let ys = y_scale(a);
        for &t in &a.ticks {
            canvas.dotted_hline(plot.x, plot.right() - 1, ys.px(t), 2, GRID);
        }
        if let Some(band) = &panel.band {
            draw_band(canvas, &panel.xs, band, &xs, &ys);
        }
    }
    // Lines stay inside the plot; point markers may overhang its edge by their radius.
    let thick = fonts.label;
    let r = 2 + thick;
    let overhang = Rect::new(plot.x - r, plot.y - r, plot.w + 2 * r, plot.h + 2 * r);
    for style in [Style::Line, Style::Points] {
        canvas.set_clip(Some(if style == Style::Line { plot } else { overhang }));
        let all = panel.right.iter().map(|s| (s, &right_axis));
        for (series, axis) in all.chain(panel.left.iter().map(|s| (s, &left_axis))) {
            if let (Some(a), true) = (axis, series.style == style) {
                draw_series(canvas, &panel.xs, series, &xs, &y_scale(a), thick);
            }
        }
    }
    canvas.set_clip(None);

    // Ticks and labels.
    let s = fonts.label;
    let cap = 7 * s;
    let mut last_right = i32::MIN;
    for (t, label) in x_axis.ticks.iter().zip(&x_labels) {
        let x = xs.px(*t);
        canvas.line(x, plot.bottom(), x, plot.bottom() + TICK - 1, AXIS);
        let lw = Canvas::text_width(label, s);
        let lx = (x - lw / 2).clamp(cell.x + 2, cell.right() - 2 - lw);
        if lx > last_right + 2 * s {
            canvas.text(lx, plot.bottom() + TICK + GAP, label, AXIS, s);
            last_right = lx + lw;
        }
    }
    let two_axes = right_axis.is_some() && left_axis.is_some();
    if let Some(a) = &left_axis {
        let color = if two_axes { panel.left[0].color } else { AXIS };
        let ys = y_scale(a);
        for (t, label) in a.ticks.iter().zip(&left_labels) {
            let y = ys.px(*t);
            canvas.line(plot.x - TICK, y, plot.x - 1, y, AXIS);
            let lw = Canvas::text_width(label, s);
            canvas.text(plot.x - TICK - GAP - lw, y - cap / 2, label, color, s);
        }
    }
    if let Some(a) = &right_axis {
        let color = panel.right[0].color;
        let ys = y_scale(a);
        for (t, label) in a.ticks.iter().zip(&right_labels) {
            let y = ys.px(*t);
            canvas.line(plot.right(), y, plot.right() + TICK - 1, y, AXIS);
            canvas.text(plot.right() + TICK + GAP, y - cap / 2, label, color, s);
        }
    }
    draw_legend(canvas, cell, pad, title_h, panel, fonts);
}

fn draw_band(canvas: &mut Canvas, xs: &[f64], band: &Band, x_scale: &Scale, y_scale: &Scale) {
    let mut prev: Option<(f64, f64, f64)> = None;
    for (i, &x) in xs.iter().enumerate() {
        let Some((lo, hi)) = band.at(i) else {
            prev = None;
            continue;
        };
        let cur = (x_scale.map(x), y_scale.map(lo), y_scale.map(hi));
        if let Some(p) = prev {
            let (xa, xb) = (p.0.round() as i32, cur.0.round() as i32);
            for px in xa.min(xb)..=xa.max(xb) {
                let t = if xb == xa {
                    0.0
                } else {
                    (px - xa) as f64 / (xb - xa) as f64
                };
                let y_lo = p.1 + t * (cur.1 - p.1);
                let y_hi = p.2 + t * (cur.2 - p.2);
                canvas.line(px, y_lo.round() as i32, px, y_hi.round() as i32, band.color);
            }
        } else {
            canvas.line(
                cur.0 as i32,
                cur.1 as i32,
                cur.0 as i32,
                cur.2 as i32,
                band.color,
            );
        }
        prev = Some(cur);
    }
}

fn draw_series(
    canvas: &mut Canvas,
    xs: &[f64],
    series: &Series,
    x_scale: &Scale,
    y_scale: &Scale,
    thick: i32,
) {
    let point = |i: usize| series.value(i).map(|v| (x_scale.px(xs[i]), y_scale.px(v)));
    let n = xs.len().min(series.values.len());
    for i in 0..n {
        let Some((x, y)) = point(i) else { continue };
        match series.style {
            Style::Points => canvas.marker(x, y, 1 + thick, series.color),
            Style::Line => {
                let prev = if i > 0 { point(i - 1) } else { None };
                let next = if i + 1 < n { point(i + 1) } else { None };
                if let Some((px, py)) = prev {
                    canvas.thick_line(px, py, x, y, thick, series.color);
                } else if next.is_none() {
                    canvas.marker(x, y, thick + 1, series.color);
                }
            }
        }
    }
}

/// Legend entries (swatch + name), right-aligned on the title line, when a panel has more
/// than one thing drawn.
fn draw_legend(
    canvas: &mut Canvas,
    cell: Rect,
    pad: i32,
    title_h: i32,
    panel: &Panel,
    fonts: Fonts,
) {
    let mut entries: Vec<(&str, Rgb, Option<Style>)> = Vec::new();
    for s in panel.left.iter().chain(&panel.right) {
        if s.has_data() {
            entries.push((&s.name, s.color, Some(s.style)));
        }
    }
    if let Some(b) = &panel.band {
        entries.push((&b.name, b.color, None));
    }
    if entries.len() < 2 {
        return;
    }
    let s = fonts.label;
    let swatch = 7 * s;
    let entry_w = |name: &str| swatch + 2 * s + Canvas::text_width(name, s);
    let total: i32 = entries
        .iter()
        .map(|(n, _, _)| entry_w(n) + 5 * s)
        .sum::<i32>()
        - 5 * s;
    let title_right = cell.x + pad + Canvas::text_width(&panel.title, fonts.title);
    let mut x = (cell.right() - pad - total).max(title_right + 6 * s);
    let y = cell.y + pad + (title_h - 7 * s) / 2;
    let mid = y + 7 * s / 2;
    for (name, color, style) in entries {
        match style {
            Some(Style::Line) => canvas.thick_line(x, mid, x + swatch - 1, mid, s, color),
            Some(Style::Points) => canvas.marker(x + swatch / 2, mid, 1 + s, color),
            None => canvas.fill_rect(Rect::new(x, y, swatch, 7 * s), color),
        }
        canvas.text(x + swatch + 2 * s, y, name, INK, s);
        x += entry_w(name) + 5 * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_maps_min_and_max_to_the_edges() {
        let plot = Rect::new(40, 20, 300, 200);
        let xs = Scale::new(-3.0, 7.0, plot.x as f64, (plot.right() - 1) as f64);
        assert_eq!(xs.px(-3.0), plot.x);
        assert_eq!(xs.px(7.0), plot.right() - 1);
        assert_eq!(xs.px(2.0), plot.x + 150);
        // y is flipped: the minimum is at the bottom edge.
        let ys = Scale::new(0.5, 1.5, (plot.bottom() - 1) as f64, plot.y as f64);
        assert_eq!(ys.px(0.5), plot.bottom() - 1);
        assert_eq!(ys.px(1.5), plot.y);
        assert!(ys.px(1.0) > plot.y && ys.px(1.0) < plot.bottom() - 1);
        // A degenerate data range maps to the middle instead of dividing by zero.
        assert_eq!(Scale::new(1.0, 1.0, 0.0, 10.0).map(1.0), 5.0);
    }

    #[test]
    fn nice_axis_covers_the_data_with_round_ticks() {
        let a = nice_axis(0.013, 0.871, 5, false);
        assert_eq!(a.lo, 0.0);
        assert!((a.step - 0.2).abs() < 1e-12);
        assert!((a.hi - 1.0).abs() < 1e-12);
        assert_eq!(a.ticks.len(), 6);
        assert_eq!(a.ticks.first(), Some(&a.lo));
        let a = nice_axis(-2.4, 3.1, 5, false);
        assert!(a.lo <= -2.4 && a.hi >= 3.1, "{a:?}");
        assert!(a.ticks.len() >= 4 && a.ticks.len() <= 8, "{a:?}");
        let a = nice_axis(1.0, 20.0, 6, true);
        assert_eq!((a.lo, a.hi, a.step), (0.0, 20.0, 5.0));
        let a = nice_axis(1.0, 3.0, 6, true);
        assert_eq!(a.step, 1.0);
        // Point ranges are widened rather than collapsing the scale.
        let a = nice_axis(0.0, 0.0, 5, false);
        assert_eq!((a.lo, a.hi), (0.0, 1.0));
        let a = nice_axis(7.0, 7.0, 6, true);
        assert!(a.lo <= 6.0 && a.hi >= 8.0);
        let a = nice_axis(-4.0, -4.0, 5, false);
        assert!(a.lo < -4.0 && a.hi > -4.0);
    }

    #[test]
    fn tick_labels_are_short_and_exact() {
        let labels = |lo, hi, integer| tick_labels(&nice_axis(lo, hi, 5, integer));
        assert_eq!(
            labels(0.0, 1.0, false),
            ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]
        );
        assert_eq!(
            labels(-1.0, 1.0, false),
            ["-1.0", "-0.5", "0", "0.5", "1.0"]
        );
        assert_eq!(
            labels(0.0, 100.0, true),
            ["0", "20", "40", "60", "80", "100"]
        );
        assert_eq!(
            labels(0.0, 0.0004, false),
            ["0", "1e-4", "2e-4", "3e-4", "4e-4"]
        );
        assert_eq!(
            labels(0.0, 250000.0, false),
            ["0", "0.5e5", "1.0e5", "1.5e5", "2.0e5", "2.5e5"]
        );
        assert_eq!(format_tick(-1e-17, 0.1, 1.0), "0");
        assert_eq!(format_tick(0.025, 0.005, 0.05), "0.025");
    }

    fn count(canvas: &Canvas, rect: Rect, color: Rgb) -> usize {
        let mut n = 0;
        for y in rect.y..rect.bottom() {
            for x in rect.x..rect.right() {
                n += (canvas.get(x, y) == Some(color)) as usize;
            }
        }
        n
    }

    #[test]
    fn panels_draw_their_series_or_say_n_a() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        let rising = Series::new(
            "a",
            BLUE,
            Style::Line,
            xs.iter().map(|&x| Some(x * x)).collect(),
        );
        let empty = Series::new("b", ORANGE, Style::Line, vec![None; 10]);
        let fig = Figure {
            title: "test".into(),
            cols: 2,
            panels: vec![
                Panel::new("with data", xs.clone()).left(rising),
                Panel::new("nothing", xs.clone()).left(empty),
            ],
        };
        let canvas = fig.render(900, 400);
        let header = Canvas::text_height(2) + 12;
        let left = Rect::new(0, header, 450, 400 - header);
        let right = Rect::new(450, header, 450, 400 - header);
        assert!(count(&canvas, left, BLUE) > 200, "line drawn");
        assert_eq!(count(&canvas, right, BLUE), 0);
        assert_eq!(count(&canvas, right, ORANGE), 0, "no data, no line");
        // "n/a" in muted grey around the middle of the empty panel.
        let middle = Rect::new(450 + 150, header + 80, 250, 180);
        assert!(count(&canvas, middle, MUTED) > 30);
        assert!(count(&canvas, left, AXIS) > 100, "frame, ticks and labels");
    }

    #[test]
    fn the_line_rises_left_to_right_in_pixels() {
        let xs: Vec<f64> = (0..5).map(f64::from).collect();
        let s = Series::new("a", RED, Style::Line, xs.iter().map(|&x| Some(x)).collect());
        let fig = Figure {
            title: String::new(),
            cols: 1,
            panels: vec![Panel::new("t", xs).left(s)],
        };
        let canvas = fig.render(500, 300);
        let red: Vec<(i32, i32)> = (0..300)
            .flat_map(|y| (0..500).map(move |x| (x, y)))
            .filter(|&(x, y)| canvas.get(x, y) == Some(RED))
            .collect();
        let leftmost = red.iter().min_by_key(|p| p.0).unwrap();
        let rightmost = red.iter().max_by_key(|p| p.0).unwrap();
        assert!(leftmost.1 > rightmost.1 + 100, "{leftmost:?} {rightmost:?}");
    }

    #[test]
    fn nan_and_missing_values_leave_gaps() {
        let xs: Vec<f64> = (0..3).map(f64::from).collect();
        let s = Series::new(
            "a",
            RED,
            Style::Line,
            vec![Some(f64::NAN), None, Some(f64::INFINITY)],
        );
        let panel = Panel::new("t", xs).left(s);
        assert!(!panel.has_data());
    }
}
