"""What a plan tells its reader: the summary, explain, the step as a formula, the HTML page, and
the coverage of a model's ops by the rules."""
