//! Small-multiples line plots for `train --plot` and `report --plot`: one panel per
//! codec family, the fp32 reference in black in every panel, each variant of the family
//! in its own colour (a colour-blind-safe palette, no repeats within a panel), error
//! feedback dashed in its variant's colour, and every legend beside its panel, outside
//! the data.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One line.
pub struct Series {
    pub name: String,
    pub pts: Vec<(f64, f64)>,
    /// Drawn dashed (error feedback), in the colour of the solid series of the same
    /// `variant`.
    pub dashed: bool,
    /// Series of one variant share a colour.
    pub variant: usize,
}

/// One panel: a codec family.
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// The axes every panel shares.
pub struct Axes {
    pub x: (f64, f64),
    pub x_log: bool,
    pub x_label: String,
    pub y_label: String,
}

/// Okabe and Ito's colour-blind-safe palette, without its yellow (too light on white).
const PALETTE: [RGBColor; 6] = [
    RGBColor(0x00, 0x72, 0xB2),
    RGBColor(0xD5, 0x5E, 0x00),
    RGBColor(0x00, 0x9E, 0x73),
    RGBColor(0xCC, 0x79, 0xA7),
    RGBColor(0xE6, 0x9F, 0x00),
    RGBColor(0x56, 0xB4, 0xE9),
];

/// The family a spec belongs to in the plots: its codec name, with the 16-bit floats and
/// natural with ternary sharing a panel.
pub fn family(spec: &str) -> &'static str {
    match spec.split(':').next().unwrap_or(spec) {
        "fp16" | "bf16" => "fp16, bf16",
        "int8" => "int8",
        "qsgd" => "QSGD",
        "natural" | "ternary" => "natural, ternary",
        "sign" => "sign",
        "topk" => "top-k",
        "randk" => "random-k",
        _ => "other",
    }
}

/// Group `(spec, series)` pairs into panels by [`family`], in first-seen order.
pub fn by_family(series: Vec<(String, Series)>) -> Vec<Panel> {
    let mut panels: Vec<Panel> = Vec::new();
    for (spec, s) in series {
        let title = family(&spec);
        match panels.iter_mut().find(|p| p.title == title) {
            Some(p) => p.series.push(s),
            None => panels.push(Panel {
                title: title.to_string(),
                series: vec![s],
            }),
        }
    }
    panels
}

/// Draw `panels` (two columns) with `reference` in every one, log-scaled y shared by all.
pub fn small_multiples(
    path: &Path,
    title: &str,
    panels: &[Panel],
    reference: &Series,
    axes: &Axes,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let ys = panels
        .iter()
        .flat_map(|p| p.series.iter())
        .chain(std::iter::once(reference))
        .flat_map(|s| s.pts.iter().map(|p| p.1))
        .filter(|y| y.is_finite() && *y > 0.0);
    let (lo, hi) = ys.fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 {
        (lo * 0.85, hi * 1.15)
    } else {
        (0.1, 10.0)
    };
    let cols = 2;
    let rows = panels.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (1400, 60 + 300 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let cells = root.split_evenly((rows, cols));
    for (panel, cell) in panels.iter().zip(cells.iter()) {
        draw_panel(cell, panel, reference, axes, (lo, hi)).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type DrawResult =
    Result<(), DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

fn draw_panel(
    cell: &DrawingArea<SVGBackend<'_>, Shift>,
    panel: &Panel,
    reference: &Series,
    axes: &Axes,
    (lo, hi): (f64, f64),
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (w, _) = cell.dim_in_pixel();
    let (plot_area, legend) = cell.split_horizontally(w * 56 / 100);
    let mut builder = ChartBuilder::on(&plot_area);
    builder
        .caption(&panel.title, ("sans-serif", 17))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(52);
    let style = |s: &Series| {
        if s.variant == usize::MAX {
            BLACK.stroke_width(3)
        } else {
            PALETTE[s.variant % PALETTE.len()].stroke_width(2)
        }
    };
    let series: Vec<&Series> = std::iter::once(reference).chain(&panel.series).collect();
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(axes.x_label.as_str())
                .y_desc(axes.y_label.as_str())
                .label_style(("sans-serif", 12))
                // Within a decade the log axis needs more labels to show any but 1.
                .y_labels(if hi / lo <= 10.0 { 10 } else { 6 })
                .y_label_formatter(&|v| short(*v))
                .x_label_formatter(&|v| short(*v))
                .max_light_lines(3)
                .draw()
                .map_err(|x| e(&x))?;
            for s in &series {
                if s.dashed {
                    chart
                        .draw_series(DashedLineSeries::new(s.pts.clone(), 7, 5, style(s)))
                        .map_err(|x| e(&x))?;
                } else {
                    chart
                        .draw_series(LineSeries::new(s.pts.clone(), style(s)))
                        .map_err(|x| e(&x))?;
                }
            }
        }};
    }
    let (x0, x1) = axes.x;
    if axes.x_log {
        draw!(
            builder
                .build_cartesian_2d((x0..x1).log_scale(), (lo..hi).log_scale())
                .map_err(|x| e(&x))?
        );
    } else {
        draw!(
            builder
                .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
                .map_err(|x| e(&x))?
        );
    }
    draw_legend(&legend, &series, style).map_err(|x| e(&x))
}

/// An axis value with at most three significant digits and no trailing zeros (log axes
/// otherwise print `0.7000000000000001`).
fn short(v: f64) -> String {
    let s = format!("{:.3}", v);
    let s = if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        s
    };
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// The legend beside a panel: a line sample (dashed where the series is) and the name.
fn draw_legend(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    series: &[&Series],
    style: impl Fn(&Series) -> ShapeStyle,
) -> DrawResult {
    let top = 46;
    for (i, s) in series.iter().enumerate() {
        let y = top + 20 * i as i32;
        let st = style(s);
        if s.dashed {
            area.draw(&PathElement::new(vec![(4, y), (12, y)], st))?;
            area.draw(&PathElement::new(vec![(18, y), (26, y)], st))?;
        } else {
            area.draw(&PathElement::new(vec![(4, y), (26, y)], st))?;
        }
        area.draw(&Text::new(
            s.name.clone(),
            (32, y - 7),
            ("sans-serif", 13).into_font().color(&BLACK),
        ))?;
    }
    Ok(())
}
